"""The web view of a bf16 run watched by a GradWatch under policy observe, in a real browser
against a live exporter: the mode and policy shown, no loss-scale chart, the verdict naming
the step at which the weights went non-finite and the rank the inf came from.

The ranks are schema-valid records posted over HTTP, as a watch rank's reporter sends them
(scale 1, event none, no backoffs, the non-finite-applied totals)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support import free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.schema import StepRecord
from exporter.factory import body, record, totals, watch
from exporter.web.browser import chromium, console_errors, foreign, requested_urls
from exporter.web.conftest import get_json

RUN = "bf16-run"
MIXED = "mixed-run"
"""A scaler (rank 0, fp16) beside a watch (rank 1, fp32): only the scaler has a scale line."""
STEPS = 30
BAD_FROM = 12
"""Rank 1's batch holds an inf at this step; the all-reduce spreads it, both ranks step on
it (policy observe), and from then on every gradient is non-finite."""
WAIT_S = 20


def watch_run(now: float) -> list[list[StepRecord]]:
    """Per rank, the records of a two-rank bf16 run under observe, the last one at ``now``."""
    ranks = []
    for rank in (0, 1):
        device = f"cuda:{rank}"
        own_from = BAD_FROM if rank == 1 else BAD_FROM + 1  # rank 0: once the weights are NaN
        records = []
        for step in range(1, STEPS + 1):
            bad, own = step >= BAD_FROM, step >= own_from
            applied = max(0, step - BAD_FROM + 1)
            record = watch(
                step,
                run=RUN,
                rank=rank,
                time=now - (STEPS - step),
                found_inf=bad,
                total=totals(
                    step,
                    local={device: applied},
                    origin={device: max(0, step - own_from + 1)},
                    params={"layers.0.attn.wo.weight": 4096 * applied} if bad else {},
                    applied=applied,
                    first_applied=(BAD_FROM, rank == 1) if bad else None,
                ),
            )
            records.append(
                record.model_copy(
                    update={"found_inf_local": {device: bad}, "found_inf_origin": {device: own}}
                )
            )
        ranks.append(records)
    return ranks


def post(url: str, records: list[StepRecord]) -> None:
    request = urllib.request.Request(
        f"{url}/api/v1/ingest",
        data=body(*records),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        now = time.time()
        for records in watch_run(now):
            post(process.url, records)
        scales = [2.0**16 if step < 6 else 2.0**15 for step in range(1, 11)]
        post(
            process.url,
            [record(s, run=MIXED, time=now - 10 + s, scale=scales[s - 1]) for s in range(1, 11)],
        )
        post(
            process.url,
            [
                watch(s, run=MIXED, rank=1, policy="skip", grad_dtype="float32", time=now - 10 + s)
                for s in range(1, 11)
            ],
        )
        yield process.url
    finally:
        process.stop()


def _wait(driver: Any, script: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def _visible(driver: Any, element_id: str) -> bool:
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]);"
        "return e.offsetParent !== null && e.getBoundingClientRect().height > 0;",
        element_id,
    )


def test_a_watch_run_shows_mode_policy_no_scale_chart_and_the_verdict(
    exporter: str, tmp_path
) -> None:
    health = get_json(f"{exporter}/api/v1/runs/{RUN}/health")
    ranks = get_json(f"{exporter}/api/v1/runs/{RUN}/ranks")
    verdict = {v["rule"]: v for v in health["verdicts"]}["nonfinite_update_applied"]
    assert verdict["status"] == "critical"
    assert (verdict["evidence"]["first_step"], verdict["evidence"]["origin_ranks"]) == (
        BAD_FROM,
        [1],
    )

    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={RUN}")
        _wait(driver, "window.ampscopeRun.series && window.ampscopeRun.skipsPlot")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 2")
        setup = "no loss scale: bfloat16 watch, policy observe"
        assert driver.find_element("id", "setup").text == setup

        # No scale chart: a note says why, where the chart would be.
        assert driver.execute_script("return window.ampscopeRun.scalePlot") is None
        assert not _visible(driver, "scale-section")
        assert _visible(driver, "no-scale")
        assert driver.find_element("id", "no-scale-text").text == setup
        assert driver.find_element("id", "skips-title").text == "Skipped steps"
        # Policy observe skips nothing: no bar.
        skipped = driver.execute_script("return window.ampscopeRun.skipsPlot.data[1]")
        assert skipped == [None] * STEPS

        # The verdict, as the API gives it.
        shown = driver.execute_script(
            "const li = document.querySelector('#verdicts li[data-rule=' + arguments[0] + ']');"
            "return [li.dataset.status, li.querySelector('.summary').textContent];",
            "nonfinite_update_applied",
        )
        assert shown == ["critical", verdict["summary"]]
        assert f"since step {BAD_FROM}; origin: rank(s) 1" in shown[1]
        assert driver.find_element("id", "run-status").text.lower() == "critical"

        # Ranks table: mode, no scale, no backoffs or growths, updates applied on inf/NaN.
        header = driver.execute_script(
            "return [...document.querySelectorAll('#ranks thead th')].map(th => th.textContent)"
        )
        table = driver.execute_script(
            "return [...document.querySelectorAll('#ranks tbody tr')].map(tr => "
            "[...tr.querySelectorAll('td')].map(td => td.textContent))"
        )
        for row, view in zip(table, ranks, strict=True):
            cells = dict(zip(header, row, strict=True))
            assert cells["rank"] == str(view["rank"])
            assert (cells["mode"], cells["scale"], cells["backoffs"], cells["growths"]) == (
                "watch/observe",
                "none",
                "-",
                "-",
            )
            applied = view["totals"]["nonfinite_applied"]
            assert cells["inf/NaN applied"] == str(applied) == str(STEPS - BAD_FROM + 1)

        # The found-inf heatmaps still draw, on the skips chart's axis: rank 1's origin row
        # is lit from the step the inf came in, rank 0's one step later.
        rows = driver.execute_script(
            "return window.ampscopeRun.heatmaps.origin.rows.map(r => [r.rank, r.steps])"
        )
        assert {rank: steps[0] for rank, steps in rows} == {0: BAD_FROM + 1, 1: BAD_FROM}
        driver.save_screenshot(str(tmp_path / "watch-run.png"))
        assert console_errors(driver) == []
        assert foreign(requested_urls(driver), exporter) == []


def test_the_runs_page_says_the_run_has_no_loss_scale(exporter: str, tmp_path) -> None:
    with chromium(tmp_path) as driver:
        driver.get(exporter + "/")
        row = f"document.querySelector('#runs tr[data-run=\"{RUN}\"]')"
        _wait(driver, row)
        scale = driver.execute_script(f"return {row}.querySelector('td.scale')")
        assert scale.text == "none"
        assert scale.get_attribute("title") == "no loss scale: bfloat16 watch, policy observe"
        assert console_errors(driver) == []


def test_a_mixed_run_charts_the_scaler_alone(exporter: str, tmp_path) -> None:
    series = get_json(f"{exporter}/api/v1/runs/{MIXED}/series")
    assert series["scale"][1] == [None] * 10  # the watch has no scale to give
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={MIXED}")
        _wait(driver, "window.ampscopeRun.scalePlot")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 2")
        assert driver.find_element("id", "setup").text == (
            "loss scaler; no loss scale: float32 watch, policy skip"
        )
        assert _visible(driver, "scale-section")
        assert not _visible(driver, "no-scale")
        plot = "window.ampscopeRun.scalePlot"
        assert driver.execute_script(f"return {plot}.data") == [
            series["steps"],
            series["scale"][0],
        ]
        labels = driver.execute_script(f"return {plot}.series.map(s => s.label)")
        assert labels == ["step", "rank 0"]
        modes = driver.execute_script(
            "return [...document.querySelectorAll('#ranks tbody tr')].map(tr => "
            "[...tr.querySelectorAll('td')].slice(4, 6).map(td => td.textContent))"
        )
        assert modes == [["scaler", "2^15"], ["watch/skip", "none"]]
        assert console_errors(driver) == []
