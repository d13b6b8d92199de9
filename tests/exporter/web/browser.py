"""Headless Debian chromium driven by chromium-driver through Selenium, with its console and
network logs: nothing here downloads a browser or a driver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support import need_tool

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
)


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A WebDriver session of Debian's chromium with a fresh profile in ``profile``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = need_tool("chromium")
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(
        service=Service(executable_path=need_tool("chromedriver")), options=options
    )
    try:
        # Chromium's own start-up page loads chrome:// resources; the tests judge only what
        # the exporter's pages request, so start from a blank page with empty logs.
        driver.get("about:blank")
        driver.get_log("performance")
        driver.get_log("browser")
        yield driver
    finally:
        driver.quit()


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page requested since the last call (Chrome's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def console_errors(driver: Any) -> list[str]:
    """Console messages of level SEVERE since the last call (errors, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def foreign(urls: list[str], base_url: str) -> list[str]:
    """The URLs that go anywhere but the exporter (``data:`` URLs stay in the page)."""
    return [url for url in urls if not (url.startswith(base_url + "/") or url.startswith("data:"))]
