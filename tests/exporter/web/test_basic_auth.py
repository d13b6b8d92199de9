"""The web view behind the web config's basic auth, in the real browser: the browser's
stored credentials carry the page's own API calls, and without them nothing is shown."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import free_port, stop_process

from exporter.credentials import bcrypt_hash
from exporter.factory import body, steps
from exporter.web.browser import chromium, console_errors, foreign, requested_urls

TOKEN = "web-token"
RUN = "guarded-run"
WAIT_S = 30


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("guarded")
    config = {
        "basic_auth_users": {"viewer": bcrypt_hash("viewer-pw")},
        "http_server_config": {"headers": {"X-Frame-Options": "deny"}},
    }
    (directory / "web.yml").write_text(yaml.safe_dump(config))
    (directory / "token").write_text(TOKEN)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port),
         "--web-config-file", str(directory / "web.yml"), "--token-file", str(directory / "token")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                request = urllib.request.Request(
                    url + "/api/v1/ingest",
                    data=body(*steps(1, 5, run=RUN)),
                    headers={"Authorization": f"Bearer {TOKEN}",
                             "Content-Type": "application/json"},
                )  # fmt: skip
                with urllib.request.urlopen(request, timeout=5) as response:
                    assert response.status == 200
                break
            except OSError:
                assert process.poll() is None, "exporter exited"
                assert time.monotonic() < deadline, "exporter did not start"
                time.sleep(0.2)
        yield url
    finally:
        stop_process(process)


def _wait(driver: Any, script: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def test_web_view_needs_the_password_and_works_with_it(guarded: str, tmp_path: Path) -> None:
    with chromium(tmp_path) as driver:
        driver.get(guarded + "/")
        # Headless chromium leaves the 401's password prompt pending: an empty page.
        assert RUN not in driver.page_source
        assert driver.execute_script("return document.querySelector('#runs')") is None
        console_errors(driver)  # start clean for the real visit
        # What the browser does once the user answered its prompt: send the credentials on
        # every request to the origin, the page's own fetch() calls included.
        credentials = base64.b64encode(b"viewer:viewer-pw").decode()
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {credentials}"}}
        )
        driver.get(guarded + "/")
        row = f"document.querySelector('#runs tr[data-run=\"{RUN}\"]')"
        _wait(driver, row)
        cells = driver.execute_script(
            f"return [...{row}.querySelectorAll('td')].map(td => td.textContent)"
        )
        assert cells[0] == RUN
        assert cells[4] == "5"
        driver.get(guarded + "/docs")
        paths = _wait(
            driver,
            "document.querySelectorAll('.opblock-summary-path').length > 0 && "
            "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent)",
        )
        assert "/api/v1/ingest" in [p.replace("\u200b", "") for p in paths]
        assert console_errors(driver) == []
        assert foreign(requested_urls(driver), guarded) == []
