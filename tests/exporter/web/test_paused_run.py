"""The web view of a rank that says it paused on purpose (a checkpoint save), in a real browser
against a live exporter: its state cell says running and, beside it, what it pauses for; past
the exporter's pause limit, stalled, and the pause beside it says so in the stall's colour.

The rank reports through the real reporter, whose heartbeats carry the pause that
``ampscope.paused`` opened.
"""

from __future__ import annotations

import re
import time
from typing import Any

from support import DEADLOCK_GUARD_S, free_port, wait_until

import ampscope
from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.http import HttpReporter
from exporter.factory import totals, watch
from exporter.web.browser import chromium, console_errors
from exporter.web.conftest import get_json

RUN = "bf16-saving"
WAIT_S = 20


def _wait(driver: Any, script: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def test_a_paused_rank_shows_what_it_pauses_for(tmp_path) -> None:
    process = ExporterProcess(free_port())
    process.start()
    reporter = HttpReporter(process.url, flush_interval=0.05, heartbeat_interval=0.1)
    try:
        reporter.emit(watch(1, run=RUN, time=time.time() - 1, total=totals(1)))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        with ampscope.paused("checkpoint"):
            view_url = f"{process.url}/api/v1/runs/{RUN}/ranks/0"
            wait_until(lambda: get_json(view_url).get("pause") is not None, "no pause shown")
            with chromium(tmp_path) as driver:
                driver.get(f"{process.url}/run?id={RUN}")
                _wait(driver, "document.querySelector('#ranks tbody .state.paused') !== null")
                cells = driver.execute_script(
                    "return [...document.querySelectorAll('#ranks tbody .state')]"
                    ".map(s => s.textContent)"
                )
                assert console_errors(driver) == []
        assert cells[0] == "running"
        assert re.fullmatch(r"paused \(checkpoint\) for \d+ s", cells[1]), cells
    finally:
        reporter.close(timeout=DEADLOCK_GUARD_S)
        process.stop()


def test_a_rank_paused_past_the_limit_reads_stalled_and_its_chip_says_so(tmp_path) -> None:
    # --stall-after 1 s, --pause-limit 2 s: the pause outlives its limit within seconds.
    process = ExporterProcess(free_port(), stall_after=1, env={"AMPSCOPE_PAUSE_LIMIT_S": "2"})
    process.start()
    reporter = HttpReporter(process.url, flush_interval=0.05, heartbeat_interval=0.1)
    try:
        reporter.emit(watch(1, run=RUN, time=time.time() - 1, total=totals(1)))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        with ampscope.paused("checkpoint"):
            view_url = f"{process.url}/api/v1/runs/{RUN}/ranks/0"
            wait_until(
                lambda: (
                    (view := get_json(view_url))["state"] == "stalled"
                    and view.get("pause") is not None
                ),
                "the paused rank never stalled past its limit",
            )
            with chromium(tmp_path) as driver:
                driver.get(f"{process.url}/run?id={RUN}")
                _wait(driver, "document.querySelector('#ranks tbody .state.paused') !== null")
                chips = driver.execute_script(
                    "return [...document.querySelectorAll('#ranks tbody .state')]"
                    ".map(s => [s.className, s.textContent])"
                )
                assert console_errors(driver) == []
        assert chips[0] == ["state stalled", "stalled"]
        assert chips[1][0] == "state paused over", chips
        assert re.fullmatch(
            r"paused \(checkpoint\) for \d+ s, past the pause limit", chips[1][1]
        ), chips
    finally:
        reporter.close(timeout=DEADLOCK_GUARD_S)
        process.stop()
