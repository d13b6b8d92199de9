"""The telemetry pipeline: sinks, history, snapshots, closing, the auto reporter."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import ListSink, Net, poison, run

import ampscope
from ampscope.rank.config import TelemetryConfig
from ampscope.rank.telemetry import pipeline as telemetry
from ampscope.rank.telemetry.outputs import build_sinks
from ampscope.reporter.schema import SCALE_ALIGN_STEPS, StepRecord


class RaisingSink:
    def __init__(self) -> None:
        self.calls = 0

    def emit(self, record: StepRecord) -> None:
        self.calls += 1
        raise OSError("disk full")

    def close(self, timeout: float) -> None:
        raise OSError("still full")


def _train(scaler: ampscope.GradScaler, steps: int) -> list[float]:
    model = Net()
    return run(
        scaler,
        model,
        [torch.optim.SGD(model.parameters(), lr=0.1)],
        steps,
        inject=lambda m, s: poison(m.body.weight) if s == 2 else None,
    )


def test_raising_sink_never_breaks_training(caplog: pytest.LogCaptureFixture) -> None:
    bad, good = RaisingSink(), ListSink()
    scaler = ampscope.GradScaler("cpu", reporter=bad, sinks=[good])
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        _train(scaler, 6)
        scaler.close()
    assert bad.calls == 6
    assert [r.step for r in good.records] == [1, 2, 3, 4, 5, 6], "other sinks still get all"
    assert good.closed_with is not None
    assert scaler.telemetry.snapshot().sink_errors == 6
    raised = [r for r in caplog.records if "raised" in r.getMessage()]
    assert len(raised) == 1, "logged once per sink"


def test_history_is_a_bounded_ring_and_close_flushes() -> None:
    sink = ListSink()
    scaler = ampscope.GradScaler("cpu", reporter=None, sinks=[sink], history=4, run_id="exp-1")
    _train(scaler, 9)
    # snapshot()/history() reflect every update() already called, without close().
    assert [r.step for r in scaler.telemetry.history()] == [6, 7, 8, 9]
    assert [r.step for r in scaler.telemetry.history(2)] == [8, 9]
    assert scaler.telemetry.history(0) == []
    assert scaler.telemetry.snapshot().steps == 9
    scaler.close()
    scaler.close()  # idempotent
    assert [r.step for r in sink.records] == list(range(1, 10))
    assert {r.identity.run for r in sink.records} == {"exp-1"}
    totals = sink.records[-1].totals
    assert (totals.steps, totals.skipped_steps, totals.backoffs) == (9, 1, 1)
    # Not attached: the parameter is named by its optimizer position (body.weight is 2nd).
    assert [(p.name, p.count) for p in totals.nonfinite_params] == [("group0.param1", 1)]
    # After close() the scaler keeps training as torch's, without telemetry.
    _train(scaler, 2)
    assert scaler.telemetry.snapshot().steps == 9


def test_totals_carry_the_scale_of_the_newest_aligned_step() -> None:
    sink = ListSink()
    scaler = ampscope.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=3, reporter=None, sinks=[sink]
    )
    _train(scaler, 2 * SCALE_ALIGN_STEPS + 3)
    scaler.close()
    scale_after = {r.step: r.scale_after for r in sink.records}
    assert len(set(scale_after.values())) > 2, "the scale moved: the test can tell steps apart"
    for r in sink.records:
        aligned = r.totals.aligned_scale
        if r.step < SCALE_ALIGN_STEPS:
            assert aligned is None
        else:
            assert aligned is not None
            assert aligned.step == r.step - r.step % SCALE_ALIGN_STEPS
            assert aligned.scale == scale_after[aligned.step]


def test_reporter_auto_follows_ampscope_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPSCOPE_URL", "off")
    assert build_sinks(TelemetryConfig()) == []
    monkeypatch.setenv("AMPSCOPE_URL", "http://127.0.0.1:9")
    extra = ListSink()
    sinks = build_sinks(TelemetryConfig(sinks=[extra]))
    try:
        assert type(sinks[0]).__name__ == "HttpReporter"
        assert sinks[1:] == [extra]
    finally:
        sinks[0].close(0.1)
    assert build_sinks(TelemetryConfig(reporter=None)) == []


_SCHEMELESS_SCRIPT = """
import torch
import ampscope

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = ampscope.GradScaler("cpu", init_scale=2.0**10)  # reporter="auto": AMPSCOPE_URL
for step in range(3):
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
print("trained", scaler.get_scale())
"""


def test_a_url_without_a_scheme_is_one_line_and_training_goes_on() -> None:
    env = {**os.environ, "AMPSCOPE_URL": "127.0.0.1:9478"}
    done = subprocess.run(
        [sys.executable, "-c", _SCHEMELESS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "trained 1024.0\n"
    assert done.stderr.splitlines() == [
        "ampscope: not reporting (AMPSCOPE_URL=127.0.0.1:9478): exporter URL must look like "
        "http://host:port, got '127.0.0.1:9478'"
    ]


class BlockingSink:
    """Blocks in its first emit() until released: a sink that hangs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.steps: list[int] = []

    def emit(self, record: StepRecord) -> None:
        self.entered.set()
        self.release.wait(30)
        self.steps.append(record.step)

    def close(self, timeout: float) -> None:
        pass


def test_a_blocking_sink_costs_bounded_memory_and_no_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "MAX_PENDING", 8)
    monkeypatch.setattr(telemetry, "MAX_UNDELIVERED", 4)
    sink = BlockingSink()
    scaler = ampscope.GradScaler("cpu", reporter=None, sinks=[sink], growth_interval=3)
    _train(scaler, 1)
    assert sink.entered.wait(10), "the telemetry thread is now stuck in the sink"
    _train(scaler, 29)
    assert len(scaler.telemetry._pending) <= 8, "the training thread resolved the backlog"
    snap = scaler.telemetry.snapshot()
    assert snap.steps == 30, "totals stay exact while the sink hangs"
    assert snap.skipped_steps == 1, "_train poisons its step index 2: only the 29-step call"
    assert snap.undelivered == 30 - 1 - 4, "step 1 is in the sink, the newest 4 wait"
    sink.release.set()
    scaler.close()
    assert sink.steps == [1, 27, 28, 29, 30]
