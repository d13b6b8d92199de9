"""The run page charts each rank's loss and gradient norm and rings the spike steps, in a real
browser against a live exporter fed schema-valid records with stats over HTTP: a loss spike on
rank 1, a gradient-norm spike on every rank, and rank 2's own gradients standing out."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.reporter.schema import StepRecord
from exporter.factory import record, stats
from exporter.web.browser import chromium, console_errors, foreign, requested_urls
from exporter.web.conftest import get_json
from exporter.web.test_watch_run import _visible, _wait, post

RUN = "spiky-run"
PLAIN = "plain-run"
"""A run whose ranks report no stats: no loss or norm charts."""
STEPS = 60
LOSS_SPIKE = (1, 45)
NORM_SPIKE = 50
OUTLIER = (2, 40)


def _loss(rank: int, step: int) -> float:
    return 50.0 if (rank, step) == LOSS_SPIKE else 2.0 + 0.05 * ((step * 7 + rank) % 5)


def _norm(step: int) -> float:
    return 40.0 if step == NORM_SPIKE else 1.0 + 0.02 * (step % 4)


def _records(rank: int, now: float) -> list[StepRecord]:
    rng = random.Random(rank)
    out = []
    for step in range(1, STEPS + 1):
        origin = rng.uniform(0.9, 1.1)
        if step == OUTLIER[1]:
            origin = 30.0 if rank == OUTLIER[0] else 1.0
        out.append(
            record(
                step,
                run=RUN,
                rank=rank,
                world_size=3,
                local_world_size=3,
                time=now - (STEPS - step),
                stats=stats(_loss(rank, step), _norm(step), origin),
            )
        )
    return out


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    process = ExporterProcess(free_port())
    process.start()
    try:
        now = time.time()
        for rank in range(3):
            post(process.url, _records(rank, now))
        post(process.url, [record(s, run=PLAIN, time=now - 10 + s) for s in range(1, 11)])
        yield process.url
    finally:
        process.stop()


def _data(driver: Any, plot: str) -> list[list[float | None]]:
    return driver.execute_script(f"return window.ampscopeRun.{plot}.data")


def test_loss_and_norm_per_rank_with_spikes_ringed(exporter: str, tmp_path) -> None:
    health = {v["rule"]: v for v in get_json(f"{exporter}/api/v1/runs/{RUN}/health")["verdicts"]}
    assert {rule: health[rule]["status"] for rule in ("loss_spike", "grad_norm_spike")} == {
        "loss_spike": "warning",
        "grad_norm_spike": "warning",
    }
    assert health["origin_outlier"]["summary"].startswith(
        "rank 2's own gradients were x30 the median of the other ranks at step 40"
    )
    with chromium(tmp_path) as driver:
        driver.get(f"{exporter}/run?id={RUN}")
        _wait(driver, "window.ampscopeRun.lossPlot && window.ampscopeRun.lossPlot.data[0].length")
        assert _visible(driver, "stats-section")
        steps = list(range(1, STEPS + 1))
        loss = _data(driver, "lossPlot")
        # The step axis, one line per rank, then the spike rings.
        assert len(loss) == 1 + 3 + 1
        assert loss[0] == steps
        for rank in range(3):
            assert loss[1 + rank] == pytest.approx([_loss(rank, s) for s in steps])
        assert [(s, v) for s, v in zip(steps, loss[4], strict=True) if v is not None] == [
            (45, 50.0)
        ]
        norm = _data(driver, "normPlot")
        assert len(norm) == 1 + 3 + 2
        assert norm[1] == pytest.approx([_norm(s) for s in steps])
        assert [(s, v) for s, v in zip(steps, norm[4], strict=True) if v is not None] == [
            (50, 40.0)
        ]
        # The outlier ring sits on the grad norm of its step (rank 2's own norm is not
        # plotted: it is what /metrics and the dashboard's origin panel show).
        assert [s for s, v in zip(steps, norm[5], strict=True) if v is not None] == [40]
        # Both y axes are logarithmic.
        distr = driver.execute_script(
            "return [window.ampscopeRun.lossPlot.scales.y.distr, "
            "window.ampscopeRun.normPlot.scales.y.distr]"
        )
        assert distr == [3, 3]
        shown = driver.execute_script(
            "const li = document.querySelector('#verdicts li[data-rule=loss_spike]');"
            "return [li.dataset.status, li.querySelector('.summary').textContent];"
        )
        assert shown == ["warning", health["loss_spike"]["summary"]]
        assert "loss spiked on rank 1 (node node0) at step 45" in shown[1]
        driver.save_screenshot(str(tmp_path / "spikes-run.png"))
        assert console_errors(driver) == []
        assert foreign(requested_urls(driver), exporter) == []

        # A run without stats: the charts stay hidden, the rest of the page draws.
        driver.get(f"{exporter}/run?id={PLAIN}")
        _wait(driver, "window.ampscopeRun.skipsPlot && window.ampscopeRun.series.steps.length")
        assert not _visible(driver, "stats-section")
        assert console_errors(driver) == []
