"""The rerun of a flagged iteration: the comparison rule and a single-process scaler."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ListSink
from rerun_setups import RerunLoop

import ampscope
from ampscope.rank.frontends.rerun import PassResult, compare, same_value
from ampscope.reporter.fault_rule import FaultRule

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("first", "second", "rtol", "same"),
    [
        (1.0, 1.0, 0.0, True),
        (1.0, math.nextafter(1.0, 2.0), 0.0, False),
        (1.0, math.nextafter(1.0, 2.0), 1e-6, True),
        (1.0, 1.1, 1e-6, False),
        (NAN, NAN, 0.0, True),
        (NAN, 1.0, 1.0, False),
        (INF, INF, 0.0, True),
        (INF, -INF, 1.0, False),
        (INF, 1e300, 1.0, False),
        (None, None, 0.0, True),
        (None, 1.0, 0.0, False),
    ],
)
def test_same_value(first: float | None, second: float | None, rtol: float, same: bool) -> None:
    assert same_value(first, second, rtol) is same


def test_compare_needs_loss_norm_and_finiteness_to_agree() -> None:
    clean = PassResult(loss=2.0, norm=3.0, nonfinite=False)
    assert compare(clean, PassResult(loss=2.0, norm=3.0, nonfinite=False))
    assert not compare(clean, PassResult(loss=2.0, norm=3.5, nonfinite=False))
    assert not compare(clean, PassResult(loss=2.5, norm=3.0, nonfinite=False))
    assert not compare(PassResult(loss=2.0, norm=INF, nonfinite=True), clean)
    # Non-finiteness first: two non-finite passes reproduce each other whatever their
    # finite losses (dropout with a closure that does not restore the RNG).
    assert compare(
        PassResult(loss=2.0, norm=INF, nonfinite=True),
        PassResult(loss=2.5, norm=None, nonfinite=True),
    )


SCALERS = pytest.mark.parametrize(
    "scaler", [ampscope.GradScaler, ampscope.ShardedGradScaler], ids=["amp", "sharded"]
)


@pytest.fixture(autouse=True)
def one_rank_group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """FSDP1's sharded scaler all-reduces found-inf: give it a one-rank gloo group."""
    params = getattr(request.node, "callspec", None)
    if params is None or params.params.get("scaler") is not ampscope.ShardedGradScaler:
        yield
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loop(scaler: type[ampscope.GradScaler] = ampscope.GradScaler) -> RerunLoop:
    """A single-process float32 loop on the CPU through a fresh ``scaler``, its records
    kept in ``loop.sink``. One clean iteration makes its scale clean (``settle_steps=1``):
    an overflow after it is a fault, which alone is rerun."""
    sink = ListSink()
    loop = RerunLoop(
        scaler(
            "cpu",
            init_scale=4.0,
            reporter=None,
            sinks=[sink],
            fault_rule=FaultRule(settle_steps=1),
        )
    )
    loop.sink = sink  # type: ignore[attr-defined]
    return loop


@SCALERS
def test_clean_iterations_never_call_the_closure(scaler: type) -> None:
    loop = _loop(scaler)
    for step in range(5):
        loop.step(step)
    assert loop.calls == 0
    assert loop.front_end.last_rerun is None


@SCALERS
def test_one_time_fault_is_transient_and_the_step_uses_the_rerun(scaler: type) -> None:
    loop, clean = _loop(scaler), _loop(scaler)
    for step in range(4):
        loop.corrupt_once = step == 2
        loop.step(step)
        clean.step(step)
    assert loop.calls == 1
    outcome = loop.front_end.last_rerun
    assert outcome is not None
    assert outcome.flagged
    assert not outcome.reproduced
    assert outcome.first.nonfinite
    assert not outcome.second.nonfinite
    assert outcome.first.loss == outcome.second.loss
    # The step went on with the rerun's gradients: the weights are a clean run's.
    for mine, theirs in zip(loop.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert loop.front_end.get_scale() == clean.front_end.get_scale()
    loop.front_end.close()
    records = loop.sink.records
    assert [r.rerun is not None for r in records] == [False, False, True, False]
    rerun = records[2].rerun
    assert rerun is not None
    assert rerun.flagged
    assert not rerun.reproduced
    assert rerun.first.nonfinite
    assert rerun.first.norm is None  # inf: a record carries finite values only
    assert rerun.second.norm is not None
    assert rerun.second.norm > 0
    assert rerun.first.loss == rerun.second.loss
    # The record describes the second pass: the step was taken.
    assert not records[2].skipped
    assert not records[2].found_inf_global
    # The fault rule: a transient fault of this rank's own, counted as such.
    call = records[2].nonfinite
    assert call is not None
    assert (call.kind, call.reason, call.own) == ("fault", "transient", True)
    assert records[-1].totals.faults == {"transient": 1}


@SCALERS
def test_weather_is_never_rerun(scaler: type) -> None:
    """An overflow before the scale is clean (warm-up), one above the clean scale (the
    scaler probing upward after it grew) and one right below the edge are the scaler's
    weather: no rerun, no fault. Lower still, after clean iterations there: a fault."""
    sink = ListSink()
    front_end = scaler(
        "cpu",
        init_scale=4.0,
        growth_interval=3,
        reporter=None,
        sinks=[sink],
        fault_rule=FaultRule(settle_steps=2, probe_steps=50),
    )
    loop = RerunLoop(front_end)
    loop.sink = sink  # type: ignore[attr-defined]
    # Step 0 overflows at 4 (warm-up); 1-3 clean at 2, then growth from 2 (clean scale 2);
    # step 4 overflows at 4 (probing: the edge is 4), step 5 at 2 (right below the edge);
    # 6-7 clean at 1 (clean scale 1); step 8 overflows at 1: a fault, rerun.
    for step in range(9):
        loop.corrupt_once = step in (0, 4, 5, 8)
        loop.step(step)
    front_end.close()
    records = sink.records
    calls = [
        None if r.nonfinite is None else (r.nonfinite.kind, r.nonfinite.reason) for r in records
    ]
    assert calls == [
        ("weather", "warmup"),
        None,
        None,
        None,
        ("weather", "probing"),
        ("weather", "edge"),
        None,
        None,
        ("fault", "transient"),
    ]
    assert loop.calls == 1
    assert [r.rerun is not None for r in records] == [False] * 8 + [True]
    assert [r.scale_before for r in records] == [4.0, 2.0, 2.0, 2.0, 4.0, 2.0, 1.0, 1.0, 1.0]
    assert records[-1].totals.faults == {"transient": 1}
    assert records[-1].totals.clean_scale == 1.0


@SCALERS
def test_reproduced_fault_is_still_skipped(scaler: type) -> None:
    loop = _loop(scaler)
    loop.step(0)
    before = [p.detach().clone() for p in loop.model.parameters()]
    scale = loop.front_end.get_scale()
    loop.bad_input = True
    loop.step(1)
    assert loop.calls == 1
    outcome = loop.front_end.last_rerun
    assert outcome is not None
    assert outcome.flagged
    assert outcome.reproduced
    assert math.isnan(outcome.first.loss or 0.0)
    assert math.isnan(outcome.second.loss or 0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, loop.model.parameters(), strict=True))
    assert loop.front_end.get_scale() == scale / 2
    loop.front_end.close()
    record = loop.sink.records[1]
    assert record.skipped
    assert record.rerun is not None
    assert record.rerun.reproduced
    assert record.rerun.first.loss is None  # NaN is not sent


def test_an_error_of_ampscope_s_own_in_a_rerun_is_counted_not_raised() -> None:
    """``Embedding(sparse=True)``: the local norm of a sparse gradient fails inside the
    rerun; training goes on, the error is counted, the rerun completes."""
    from helpers import Net, batch, poison

    model = Net(sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscope.GradScaler(
        "cpu", init_scale=4.0, reporter=None, fault_rule=FaultRule(settle_steps=1)
    )
    calls = 0
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = model(batch(step))
            scaler.scale(loss).backward()
            return loss

        opt.zero_grad()
        scaler.scale(model(batch(step))).backward()
        if step == 2:
            poison(model.head.weight)
        scaler.step(opt, rerun=closure)
        scaler.update()
    scaler.close()
    assert calls == 1
    outcome = scaler.last_rerun
    assert outcome is not None
    assert outcome.transient
    assert outcome.second.norm is None  # unknown: its reading failed
    assert scaler._ampscope_errors >= 1
