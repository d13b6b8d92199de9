"""The run page's FP8 layer table, in a real browser against a live exporter: one rank's
layers and cast tensors with amax, median, scale and underflow, the series the FP8 verdicts
flag marked, a rank chooser; hidden for a run without FP8 layers.

The ranks report through the real reporter: schema-valid watch records whose ``fp8`` entries
are what the rank side sends (tests/rank/fp8 proves those against torchao's own casts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import Fp8Tensor
from exporter.factory import totals, watch
from exporter.web.browser import chromium, console_errors, foreign, requested_urls
from exporter.web.conftest import get_json

RUN = "fp8-web"
STEPS = 30
WAIT_S = 20
TENSORS = ("input", "weight", "grad_output")


def _entries(rank: int, step: int) -> list[Fp8Tensor]:
    """Rank 1's layers.1 input spikes to 64 at the last step (its median 2); rank 1's
    layers.0 grad_output underflows 30 % throughout; layers.1 scales rowwise."""
    out = []
    for layer in ("layers.0", "layers.1"):
        for tensor in TENSORS:
            spike = rank == 1 and step == STEPS and (layer, tensor) == ("layers.1", "input")
            low = rank == 1 and (layer, tensor) == ("layers.0", "grad_output")
            rowwise = layer == "layers.1"
            out.append(
                Fp8Tensor(
                    layer=layer,
                    tensor=tensor,  # type: ignore[arg-type]
                    cast="grad_input_gemm" if tensor == "grad_output" else "output_gemm",
                    dtype="float8_e5m2" if tensor == "grad_output" else "float8_e4m3fn",
                    rowwise=rowwise,
                    amax=64.0 if spike else 2.0,
                    underflow_ratio=0.3 if low else 0.002,
                    scale=7.0 if spike else 224.0,
                    scale_min=112.0 if rowwise and not spike else (7.0 if spike else 224.0),
                )
            )
    return out


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        now = time.time()
        for rank in (0, 1):
            reporter = HttpReporter(process.url, flush_interval=0.05)
            for step in range(1, STEPS + 1):
                at = now - (STEPS - step) - 1
                entries = _entries(rank, step)
                reporter.emit(
                    watch(step, run=RUN, rank=rank, time=at, total=totals(step), fp8=entries)
                )
            reporter.emit(watch(1, run="no-fp8", rank=rank, time=now - 1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            reporter.close(timeout=DEADLOCK_GUARD_S)
        yield process.url
    finally:
        process.stop()


def _wait(driver: Any, script: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


ROWS = (
    "return [...document.querySelectorAll('#fp8 tbody tr')].map(tr => [tr.dataset.layer, "
    "tr.dataset.tensor, ...[...tr.children].map(td => td.textContent), tr.className, "
    "[...tr.querySelectorAll('td.bad')].map(td => td.className.split(' ')[1])])"
)


def test_the_flagged_rank_shows_first_with_its_spike_and_underflow_marked(
    exporter: str, tmp_path
) -> None:
    health = get_json(f"{exporter}/api/v1/runs/{RUN}/health")
    verdicts = {v["rule"]: v for v in health["verdicts"]}
    assert verdicts["fp8_amax_spike"]["status"] == "warning"
    assert verdicts["fp8_underflow"]["status"] == "warning"
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={RUN}")
        _wait(driver, "document.querySelectorAll('#fp8 tbody tr').length === 6")
        # Rank 1 (flagged) is shown, not the lowest rank.
        chooser = driver.execute_script(
            "const s = document.getElementById('fp8-rank');"
            "return [s.value, [...s.options].map(o => o.textContent)]"
        )
        assert chooser == ["1", ["rank 0", "rank 1 (flagged)"]]
        rows = {(r[0], r[1]): r[2:] for r in driver.execute_script(ROWS)}
        spike = rows[("layers.1", "input")]
        # layer, tensor, dtype, amax, median, scale, underflow, step, flagged; class; bad cells
        assert spike[:8] == [
            "layers.1", "input", "float8_e4m3fn rowwise", "64", "2", "7", "0.2 %", "30",
        ]  # fmt: skip
        assert spike[8] == "spike at step 30: 32x its median"
        assert (spike[9], spike[10]) == ("spike", ["amax"])
        low = rows[("layers.0", "grad_output")]
        assert low[2:7] == ["float8_e5m2", "2", "2", "224", "30.0 %"]
        assert low[8] == "underflow above the threshold in each recent observation"
        assert (low[9], low[10]) == ("", ["underflow"])
        # A rowwise cast's scale is the range of its row scales.
        assert rows[("layers.1", "weight")][5] == "112..224"
        assert driver.find_element("id", "fp8-node").text == "node node0, 6 series"

        # Choosing rank 0: calm, nothing marked, and it stays chosen across refreshes.
        driver.execute_script(
            "const s = document.getElementById('fp8-rank'); s.value = '0';"
            "s.dispatchEvent(new Event('change'));"
        )
        _wait(driver, "document.querySelector('#fp8 tbody tr td.bad') === null")
        # One refresh later (each draws from a new answer): still rank 0, not the flagged one.
        driver.execute_script("window.fp8Before = ampscopeFp8.last")
        _wait(driver, "ampscopeFp8.last !== window.fp8Before")
        assert driver.execute_script("return document.getElementById('fp8-rank').value") == "0"
        assert not [r for r in driver.execute_script(ROWS) if r[-2] or r[-1]]
        driver.save_screenshot(str(tmp_path / "fp8-run.png"))
        assert console_errors(driver) == []
        assert foreign(requested_urls(driver), exporter) == []


def test_a_run_without_fp8_layers_shows_no_fp8_table(exporter: str, tmp_path) -> None:
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id=no-fp8")
        _wait(driver, "document.querySelectorAll('#ranks tbody tr').length === 2")
        assert driver.execute_script("return document.getElementById('fp8-section').hidden")
        assert console_errors(driver) == []
