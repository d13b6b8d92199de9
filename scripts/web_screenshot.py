"""Screenshot a page of the web view with Debian's headless chromium (docs/images/run-page.png).

    python scripts/web_screenshot.py "http://127.0.0.1:9478/run?id=RUN" docs/images/run-page.png

Run it against an exporter that `ampscope demo --keep-serving` filled.
"""

from __future__ import annotations

import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def main(url: str, out: str, width: int = 1400) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                     f"--user-data-dir={profile}", f"--window-size={width},1000"):  # fmt: skip
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(url)
            time.sleep(3)  # a refresh or two: data loaded, charts drawn
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(width, height + 20)
            time.sleep(1)
            driver.save_screenshot(out)
        finally:
            driver.quit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
