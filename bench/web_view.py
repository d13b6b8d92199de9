"""``python -m bench.web_view``: what the web view costs at 64 ranks x 1024 steps.

Against a live ``ampscope serve`` on loopback, filled by simulated ranks (8 devices, an
overflow every 7th step):

* ``GET /api/v1/runs/{run}/series`` in full and as a ``since_step`` poll, side by side with
  reading the same steps through the per-rank history pages it replaces;
* with Debian's chromium (skipped when it is missing): the run page's first draw, and the
  main thread's long tasks (> 50 ms, the browser's own measure of jank) while every rank
  keeps reporting a step every 0.5 s.

Standalone (not part of ``python -m bench``); prints JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from typing import Any

from ampscope.demo.exporter import ExporterProcess
from bench.payloads import SimulatedRank

RUN = "bench-web"


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(
        url + "/api/v1/ingest", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return bytes(response.read())


def _timed(fn: Any, repeats: int) -> dict[str, float]:
    times = []
    size = 0
    for _ in range(repeats):
        start = time.perf_counter()
        size = fn()
        times.append(time.perf_counter() - start)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "bytes": size,
    }


def _histories(url: str, ranks: int) -> int:
    size = 0
    for rank in range(ranks):
        since = 0
        while True:
            page = _get(
                f"{url}/api/v1/runs/{RUN}/ranks/{rank}/history?since_step={since}&limit=1000"
            )
            size += len(page)
            since = json.loads(page)["next_since_step"]
            if since is None:
                break
    return size


def _browser(url: str, ranks: list[SimulatedRank], seconds: float) -> dict[str, Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        return {"skipped": "chromium or chromedriver not installed"}
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="ampscope-bench-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1800",
                 f"--user-data-dir={profile}"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    stop = threading.Event()

    def report() -> None:
        while not stop.is_set():
            for rank in ranks:
                _post(url, rank.ingest_batch(1))
            stop.wait(0.5)

    try:
        driver.execute_cdp_cmd(
            "Page.addScriptToEvaluateOnNewDocument",
            {
                "source": "window.__long = []; new PerformanceObserver(l => { for (const e of "
                "l.getEntries()) window.__long.push(e.duration); }).observe({entryTypes: "
                "['longtask']});"
            },
        )
        start = time.perf_counter()
        driver.get(f"{url}/run?id={RUN}")
        ready = "return !!(window.ampscopeRun && window.ampscopeRun.scalePlot)"
        while not driver.execute_script(ready):
            time.sleep(0.02)
        first_draw = time.perf_counter() - start
        driver.execute_script("window.__long = []")
        feeder = threading.Thread(target=report)
        feeder.start()
        time.sleep(seconds)
        stop.set()
        feeder.join()
        long_tasks = driver.execute_script("return window.__long")
        shown = driver.execute_script("return window.ampscopeRun.series.steps.length")
    finally:
        stop.set()
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return {
        "first_draw_s": first_draw,
        "live_seconds": seconds,
        "steps_shown": shown,
        "long_tasks": len(long_tasks),
        "long_task_ms_median": statistics.median(long_tasks) if long_tasks else 0.0,
        "long_task_ms_max": max(long_tasks, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.web_view", description=__doc__)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--live-seconds", type=float, default=20.0)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    exporter = ExporterProcess(port)
    exporter.start()
    try:
        ranks = [
            SimulatedRank(run=RUN, rank=r, world_size=args.ranks, overflow_every=7)
            for r in range(args.ranks)
        ]
        for rank in ranks:
            for _ in range(0, args.steps, 512):
                _post(exporter.url, rank.ingest_batch(min(512, args.steps - rank.step)))
        series = f"{exporter.url}/api/v1/runs/{RUN}/series"
        last = args.steps - 8
        result: dict[str, Any] = {
            "ranks": args.ranks,
            "steps": args.steps,
            "series_full": _timed(lambda: len(_get(series)), args.repeats),
            "series_poll_8_steps": _timed(
                lambda: len(_get(f"{series}?since_step={last}")), args.repeats
            ),
            "history_pages_instead": _timed(
                lambda: _histories(exporter.url, args.ranks), max(1, args.repeats // 2)
            ),
        }
        result["browser"] = _browser(exporter.url, ranks, args.live_seconds)
    finally:
        exporter.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
