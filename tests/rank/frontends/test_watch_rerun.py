"""The rerun of a flagged iteration through GradWatch (bf16/fp32), and spike-triggered reruns
through both kinds of front-end, on one process (the 4-rank case is
tests/integration/test_rerun_classifies.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import ListSink
from rerun_setups import NAN, RerunLoop

import ampscope
from ampscope.reporter.spike_rule import SpikeRule

RULE = SpikeRule(window=20, min_window=5)
"""A short window, so that a spike can be planted after a few iterations."""
POLICIES = pytest.mark.parametrize("policy", ["observe", "skip", "raise"])


def _Loop(front_end: Any) -> RerunLoop:
    """A single-process bf16 loop through ``front_end`` (:class:`rerun_setups.RerunLoop`)."""
    return RerunLoop(front_end, dtype=torch.bfloat16)


def _watch(policy: str = "skip", **options: Any) -> tuple[Any, ListSink]:
    sink = ListSink()
    watch = ampscope.GradWatch(policy, reporter=None, sinks=[sink], **options)  # type: ignore[arg-type]
    return watch, sink


@POLICIES
def test_clean_iterations_never_call_the_closure(policy: str) -> None:
    watch, sink = _watch(policy)
    loop = _Loop(watch)
    for step in range(6):
        loop.step(step)
    assert loop.calls == 0
    assert watch.last_rerun is None
    watch.close()
    assert [r.rerun for r in sink.records] == [None] * 6
    assert not any(r.skipped for r in sink.records)


@POLICIES
def test_a_one_time_fault_is_transient_and_the_step_uses_the_rerun(policy: str) -> None:
    watch, sink = _watch(policy)
    loop, clean = _Loop(watch), _Loop(_watch(policy)[0])
    for step in range(4):
        loop.corrupt_once = step == 2
        loop.step(step)
        clean.step(step)
    assert loop.calls == 1
    outcome = watch.last_rerun
    assert outcome is not None
    assert outcome.transient
    assert outcome.reason == "nonfinite"
    assert outcome.first.nonfinite
    assert not outcome.second.nonfinite
    assert outcome.first.loss == outcome.second.loss
    # The step went on with the rerun's gradients: the weights are a clean run's.
    for mine, theirs in zip(loop.model.parameters(), clean.model.parameters(), strict=True):
        assert mine.isfinite().all()
        assert torch.equal(mine, theirs)
    watch.close()
    records = sink.records
    assert [r.rerun is not None for r in records] == [False, False, True, False]
    rerun = records[2].rerun
    assert rerun is not None
    assert (rerun.reason, rerun.flagged, rerun.reproduced) == ("nonfinite", True, False)
    assert rerun.first.nonfinite
    assert not rerun.second.nonfinite
    # The record describes the second pass, the one the step used.
    assert not records[2].skipped
    assert not records[2].found_inf_global
    assert records[2].nonfinite_params == []


def test_a_reproduced_fault_is_still_skipped() -> None:
    watch, sink = _watch("skip")
    loop = _Loop(watch)
    loop.step(0)
    before = [p.detach().clone() for p in loop.model.parameters()]
    loop.bad_input = True
    loop.step(1)
    assert loop.calls == 1
    assert watch.last_step_skipped
    outcome = watch.last_rerun
    assert outcome is not None
    assert outcome.flagged
    assert outcome.reproduced
    assert math.isnan(outcome.first.loss or 0.0)
    assert math.isnan(outcome.second.loss or 0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, loop.model.parameters(), strict=True))
    watch.close()
    record = sink.records[1]
    assert record.skipped
    assert record.rerun is not None
    assert record.rerun.reproduced
    assert record.rerun.first.loss is None  # NaN is not sent


def test_raise_says_the_rerun_reproduced_it_with_step_and_batch_ids() -> None:
    watch, sink = _watch("raise")
    loop = _Loop(watch)
    loop.step(0)
    loop.bad_input = True
    with pytest.raises(ampscope.NonFiniteGradientsError) as caught:
        loop.step(1)
    assert loop.calls == 1
    error = caught.value
    assert (error.step, error.reproduced_ranks, error.transient_ranks) == (2, (0,), ())
    assert (
        "Reproducible: the rerun from the same batch reproduced it on rank(s) 0: suspect the "
        "data or the numerics of step 2. Batch ids noted at step 2: rank 0: 10, 11."
    ) in str(error)
    watch.close()
    record = sink.records[-1]
    assert record.step == 2
    assert record.rerun is not None
    assert record.rerun.reproduced
    assert record.batch is not None
    assert record.batch.ids == [10, 11]


def test_without_a_closure_unscale_then_step_agrees_as_before() -> None:
    """Once a step() took a closure, unscale_() leaves the policy's agreement to step():
    a later iteration without a closure must still skip a non-finite step."""
    watch, _ = _watch("skip")
    loop = _Loop(watch)
    loop.step(0)  # arms the rerun
    loop.bad_input = True
    loop._backward(1)
    watch.unscale_(loop.opt)
    before = [p.detach().clone() for p in loop.model.parameters()]
    assert watch.step(loop.opt) is None
    watch.update()
    assert watch.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, loop.model.parameters(), strict=True))
    watch.close()


FRONT_ENDS = pytest.mark.parametrize(
    "make",
    [
        lambda: ampscope.GradWatch(reporter=None, spike_rule=RULE),
        lambda: ampscope.GradScaler("cpu", init_scale=4.0, reporter=None, spike_rule=RULE),
    ],
    ids=["watch", "scaler"],
)


def _warm_up(loop: _Loop, steps: int) -> None:
    """Train ``steps`` clean iterations and build their records, so that the telemetry
    thread has published thresholds before the next step (history() builds on this thread)."""
    for step in range(steps):
        loop.step(step)
    loop.front_end.telemetry.history()
    thresholds = loop.front_end.telemetry.spike_thresholds
    assert thresholds.armed
    assert math.isfinite(thresholds.loss)
    assert math.isfinite(thresholds.grad_norm)


@FRONT_ENDS
def test_a_planted_loss_spike_triggers_exactly_one_rerun(make: Any) -> None:
    front_end = make()
    loop = _Loop(front_end)
    _warm_up(loop, 10)
    loop.spike = 1000.0  # the data of step 10
    loop.step(10)
    loop.spike = 0.0
    for step in range(11, 16):
        loop.step(step)
    assert loop.calls == 1
    records = front_end.telemetry.history()
    front_end.close()
    reruns = {r.step: r.rerun for r in records if r.rerun is not None}
    assert list(reruns) == [11]
    rerun = reruns[11]
    assert rerun is not None
    assert (rerun.reason, rerun.flagged, rerun.reproduced) == ("spike", True, True)
    assert records[10].stats is not None
    assert "loss" in records[10].stats.spikes  # the rank's own rule agrees on the host


@FRONT_ENDS
def test_a_spike_of_the_first_pass_only_is_transient(make: Any) -> None:
    front_end = make()
    loop, clean = _Loop(front_end), _Loop(make())
    _warm_up(loop, 10)
    _warm_up(clean, 10)
    loop.spike_once = 1000.0  # the first pass of step 10 only: a fault of the device
    loop.step(10)
    clean.step(10)
    assert loop.calls == 1
    outcome = front_end.last_rerun
    assert outcome is not None
    assert outcome.reason == "spike"
    assert outcome.first.loss_spike
    assert outcome.transient
    for mine, theirs in zip(loop.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    record = front_end.telemetry.history()[-1]
    front_end.close()
    assert record.stats is not None
    assert record.stats.spikes == []  # the record keeps the second, clean pass


@FRONT_ENDS
def test_a_spike_that_comes_back_a_little_different_is_reproduced(make: Any) -> None:
    """Non-deterministic kernels move the rerun's values by a few ulps: the spike, which
    comes back, is the data's, not a device fault."""
    front_end = make()
    loop = _Loop(front_end)
    _warm_up(loop, 10)
    loop.spike = 1000.0
    loop.spike_once = 1e-3  # the first pass only: the rerun's loss differs a little
    loop.step(10)
    assert loop.calls == 1
    outcome = front_end.last_rerun
    assert outcome is not None
    assert outcome.first.loss != outcome.second.loss
    assert outcome.second.loss_spike
    assert (outcome.reason, outcome.flagged, outcome.reproduced) == ("spike", True, True)
    front_end.close()


def test_a_nan_loss_flags_the_iteration_itself() -> None:
    """A NaN loss with finite gradients (a NaN constant added to it) flags the iteration,
    before the spike rule has any threshold."""
    watch, _ = _watch()
    loop = _Loop(watch)
    loop.spike = NAN
    loop.step(0)
    assert loop.calls == 1
    outcome = watch.last_rerun
    assert outcome is not None
    assert outcome.reason == "nonfinite"
    assert outcome.reproduced
    watch.close()


def test_consequences_of_an_applied_update_are_not_rerun() -> None:
    """Under ``observe`` a reproduced NaN is applied: the weights hold NaN from then on, and
    every later iteration is its consequence, never rerun."""
    sink = ListSink()
    loop = RerunLoop(ampscope.GradWatch("observe", reporter=None, sinks=[sink]))
    for step in range(5):
        loop.bad_input = step == 1
        loop.step(step)
    loop.front_end.close()
    assert loop.calls == 1
    calls = [
        None if r.nonfinite is None else (r.nonfinite.kind, r.nonfinite.reason)
        for r in sink.records
    ]
    assert calls == [
        None,
        ("fault", "reproducible"),
        ("consequence", "after_applied"),
        ("consequence", "after_applied"),
        ("consequence", "after_applied"),
    ]
