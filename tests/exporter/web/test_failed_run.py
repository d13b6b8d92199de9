"""The web view of a bf16 run that a GradWatch stopped on inf/NaN gradients, in a real browser
against a live exporter: the failed ranks above everything, with their exception, step,
message and origin; the state cells; the rank_failed verdict; the runs page.

The ranks report through the real reporter: schema-valid watch records, then the final
heartbeat that carries the failure GradWatch notes as it raises ``NonFiniteGradientsError``
(here noted as the watch notes it; tests/integration raises it on real gloo ranks).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.rank.frontends.stop import NonFiniteGradientsError
from ampscope.reporter import failure
from ampscope.reporter.http import HttpReporter
from exporter.factory import totals, watch
from exporter.web.browser import chromium, console_errors, foreign, requested_urls
from exporter.web.conftest import get_json

RUN = "bf16-stopped"
NAN_STEP = 5
MESSAGE = (
    f"ampscope: non-finite gradients at step {NAN_STEP}: policy 'raise' stops at the first "
    "non-finite iteration. Origin rank(s): 1."
)
WAIT_S = 20


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        now = time.time()
        reporters = []
        for rank in (0, 1):
            reporter = HttpReporter(process.url, flush_interval=0.05)
            for step in range(1, NAN_STEP + 1):
                bad = step == NAN_STEP
                reporter.emit(
                    watch(
                        step,
                        run=RUN,
                        rank=rank,
                        policy="raise",
                        time=now - (NAN_STEP - step) - 1,
                        found_inf=bad,
                        total=totals(step, skipped=int(bad)),
                    )
                )
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            reporters.append(reporter)
        # What every rank's GradWatch notes as it raises, with the same gathered words.
        failure.note(
            NonFiniteGradientsError(
                MESSAGE, step=NAN_STEP, origin_ranks=(1,), local_ranks=(0, 1), params=()
            )
        )
        for reporter in reporters:
            reporter.close(timeout=DEADLOCK_GUARD_S)
        failure.forget()
        yield process.url
    finally:
        process.stop()


def _wait(driver: Any, script: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def test_a_stopped_run_shows_its_failed_ranks_first(exporter: str, tmp_path) -> None:
    health = get_json(f"{exporter}/api/v1/runs/{RUN}/health")
    verdict = {v["rule"]: v for v in health["verdicts"]}["rank_failed"]
    assert (health["status"], health["state"], verdict["status"]) == (
        "critical",
        "failed",
        "critical",
    )
    assert (verdict["evidence"]["step"], verdict["evidence"]["origin_ranks"]) == (NAN_STEP, [1])

    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={RUN}")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 2")
        _wait(driver, "!document.getElementById('failure').hidden")
        # The failed ranks, above the verdicts, in words.
        box = driver.execute_script(
            "const box = document.getElementById('failure').getBoundingClientRect();"
            "const verdicts = document.getElementById('verdicts-section').getBoundingClientRect();"
            "return [box.height > 0, box.bottom <= verdicts.top];"
        )
        assert box == [True, True]
        items = driver.execute_script(
            "return [...document.querySelectorAll('#failures li')].map(li => "
            "[li.dataset.rank, li.querySelector('.what').textContent, "
            "li.querySelector('.message').textContent])"
        )
        what = f"NonFiniteGradientsError at step {NAN_STEP} (origin rank(s) 1)"
        assert items == [["0", what, MESSAGE], ["1", what, MESSAGE]]
        assert driver.find_element("id", "failure").text.startswith("Training failed")

        # The state cells say failed, in the critical colour, the exception on hover.
        cells = driver.execute_script(
            "return [...document.querySelectorAll('#ranks tbody .state')].map(s => "
            "[s.textContent, s.title, getComputedStyle(s).backgroundColor])"
        )
        state = ["failed", f"NonFiniteGradientsError at step {NAN_STEP}", "rgb(198, 40, 40)"]
        assert cells == [state, state]

        # The verdict, as the API gives it, and the run's badge.
        shown = driver.execute_script(
            "const li = document.querySelector('#verdicts li[data-rule=rank_failed]');"
            "return [li.dataset.status, li.querySelector('.summary').textContent];"
        )
        assert shown == ["critical", verdict["summary"]]
        assert driver.find_element("id", "run-status").text.lower() == "critical"
        driver.save_screenshot(str(tmp_path / "failed-run.png"))
        assert console_errors(driver) == []
        assert foreign(requested_urls(driver), exporter) == []

        # The runs page: critical, both ranks failed, the verdict flagged.
        driver.get(exporter + "/")
        row = f"document.querySelector('#runs tr[data-run=\"{RUN}\"]')"
        _wait(driver, row)
        texts = driver.execute_script(
            f"const r = {row}; return [r.querySelector('.health').textContent, "
            "r.querySelector('.states').textContent, r.querySelector('.flagged').textContent]"
        )
        assert texts[0].lower() == "critical"
        assert texts[1] == "2 failed"
        assert "rank_failed" in texts[2]
        assert console_errors(driver) == []


def test_a_run_that_ends_normally_shows_no_failure(exporter: str, tmp_path) -> None:
    reporter = HttpReporter(exporter, flush_interval=0.05)
    reporter.emit(watch(1, run="bf16-fine", time=time.time() - 1))
    reporter.close(timeout=DEADLOCK_GUARD_S)
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id=bf16-fine")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 1")
        assert driver.execute_script("return document.getElementById('failure').hidden")
        state = driver.execute_script("return document.querySelector('#ranks tbody .state').title")
        assert state == ""
        assert console_errors(driver) == []


def test_a_rank_its_launcher_stopped_shows_stopped_and_its_signal(exporter: str, tmp_path) -> None:
    # What the SIGTERM handler does (tests/reporter/test_stop_signal.py sends the signal).
    reporter = HttpReporter(exporter, flush_interval=0.05, sigterm_handler=False)
    reporter.emit(watch(1, run="bf16-preempted", time=time.time() - 1))
    assert reporter.flush(timeout=DEADLOCK_GUARD_S)
    reporter._pipeline.note_stop(15)
    reporter.close(timeout=DEADLOCK_GUARD_S)
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id=bf16-preempted")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 1")
        assert driver.execute_script("return document.getElementById('failure').hidden")
        cell = driver.execute_script(
            "const s = document.querySelector('#ranks tbody .state');"
            "return [s.textContent, s.title, getComputedStyle(s).backgroundColor]"
        )
        assert cell == ["stopped", "stopped by SIGTERM (signal 15)", "rgb(225, 190, 231)"]
        assert driver.find_element("id", "run-status").text.lower() == "ok"
        assert console_errors(driver) == []
        driver.get(exporter + "/")
        row = "document.querySelector('#runs tr[data-run=\"bf16-preempted\"]')"
        _wait(driver, row)
        assert driver.execute_script(f"return {row}.querySelector('.states').textContent") == (
            "1 stopped"
        )
