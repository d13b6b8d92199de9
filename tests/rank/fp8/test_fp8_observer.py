"""The rank side's FP8 values equal what the layer's own cast did (real torchao
Float8Linear layers, emulated on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from fp8_setups import check_records, data, fp8_model, independent_hooks, train
from helpers import ListSink

import ampscope
from ampscope.rank.capture.scaler import StepCapture
from ampscope.rank.capture.watch import WatchCapture


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("transport", ["host", "device"])
def test_watch_values_equal_the_layers_own_cast(recipe: str, transport: str) -> None:
    model = fp8_model(recipe)
    seen = independent_hooks(model)
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    if transport == "device":  # the accelerators' path: one stacked copy, read later
        watch._ampscope_capture = WatchCapture("observe", read_on_host=False)
    watch.attach(model, fp8_every=1)
    train(watch, model, 4)
    assert len(sink.records) == 4
    check_records(sink.records, seen, [1.0] * 4)
    entry = sink.records[0].fp8[0]  # type: ignore[index]
    assert entry.rowwise is (recipe == "rowwise")
    if recipe == "rowwise":
        assert entry.scale_min is not None
        assert entry.scale is not None
        assert entry.scale_min < entry.scale


@pytest.mark.parametrize("transport", ["host", "device"])
def test_scaler_reports_grad_output_unscaled(transport: str) -> None:
    model = fp8_model()
    seen = independent_hooks(model)
    sink = ListSink()
    scaler = ampscope.GradScaler(
        "cpu", init_scale=2.0**12, growth_interval=2, reporter=None, sinks=[sink]
    )
    if transport == "device":
        scaler._ampscope_capture = StepCapture(read_on_host=False)
    scaler.attach(model, fp8_every=1)
    train(scaler, model, 5)
    scales = [r.scale_before for r in sink.records]
    assert len(set(scales)) > 1  # the scale grew: each step is unscaled by its own
    check_records(sink.records, seen, scales)


def test_observes_one_iteration_in_fp8_every() -> None:
    model = fp8_model()
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink], fp8_every=3)
    watch.attach(model)
    train(watch, model, 7)
    assert [r.step for r in sink.records if r.fp8 is not None] == [1, 4, 7]


def test_no_fp8_layers_no_fp8_values() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    assert watch._ampscope_fp8 is None
    train(watch, model, 2)
    assert [r.fp8 for r in sink.records] == [None, None]


def test_close_removes_the_hooks() -> None:
    model = fp8_model()
    watch = ampscope.GradWatch(reporter=None)
    watch.attach(model, fp8_every=1)
    head = model.head
    assert len(head._forward_pre_hooks) == 1
    watch.close()
    assert len(head._forward_pre_hooks) == 0


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_fp8_every_must_be_a_positive_int(every: object) -> None:
    with pytest.raises(ValueError, match="fp8_every"):
        ampscope.GradWatch(reporter=None, fp8_every=every)
    watch = ampscope.GradWatch(reporter=None)
    with pytest.raises(ValueError, match="fp8_every"):
        watch.attach(fp8_model(), fp8_every=every)  # type: ignore[arg-type]
    watch.close()


def test_a_non_finite_amax_is_reported_as_none() -> None:
    model = fp8_model()
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = data(0)
    x[0, 0] = math.inf
    optimizer.zero_grad()
    model(x).square().mean().backward()
    watch.step(optimizer)
    watch.update()
    watch.close()
    (record,) = sink.records
    first = {(e.layer, e.tensor): e for e in record.fp8 or ()}
    assert first[("blocks.0.up", "input")].amax is None
    # No threshold without an amax: the finite elements are not counted as underflowed.
    assert first[("blocks.0.up", "input")].underflow_ratio < 0.5


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_amax_counts_no_underflow(value: float) -> None:
    from ampscope.rank import compat
    from ampscope.rank.fp8.casts import cast_stats

    model = fp8_model()
    cast = compat.float8_casts(model.blocks[0].up)[0]
    x = data(0)
    x[0, 0] = value
    stats = cast_stats(x, cast)
    assert float(stats.nonzero.item()) == x.numel()
    assert float(stats.underflowed.item()) <= 1.0  # the inf/NaN element at most


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_two_micro_batches_combine_into_one_entry(recipe: str) -> None:
    """Gradient accumulation: each layer casts twice in the iteration; its entry holds the
    larger amax, the larger and smaller scale, and a pooled underflow ratio."""
    model = fp8_model(recipe)
    seen = independent_hooks(model)
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    optimizer.zero_grad()
    for micro in range(2):
        watch.scale(model(data(micro)).square().mean()).backward()
    watch.step(optimizer)
    watch.update()
    watch.close()
    (record,) = sink.records
    assert record.fp8 is not None
    for entry in record.fp8:
        mine = seen[(entry.layer, entry.tensor)]
        assert entry.calls == 2
        assert entry.amax == pytest.approx(max(mine.amax), rel=1e-2)
        assert entry.scale == pytest.approx(max(mine.scale), rel=1e-2)
        if recipe == "tensorwise":
            assert entry.scale_min == pytest.approx(min(mine.scale), rel=1e-2)
        low, high = sorted(mine.underflow)
        assert low - 1e-3 <= entry.underflow_ratio <= high + 1e-3


def test_a_rerun_records_the_kept_pass_alone() -> None:
    """A flagged iteration rerun from the same batch: the record's FP8 entries and batch
    ids are the second pass's, not both passes' combined."""
    model = fp8_model()
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    watch.attach(model, fp8_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = data(0)
    corrupt = [True]

    def backward() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        watch.scale(loss).backward()
        if corrupt[0]:
            corrupt[0] = False
            param = next(model.parameters())
            assert param.grad is not None
            param.grad.view(-1)[0] = math.inf
        return loss

    watch.note_batch([1, 2])
    backward()
    watch.step(optimizer, rerun=backward)
    watch.update()
    watch.close()
    (record,) = sink.records
    assert record.rerun is not None
    assert not record.rerun.reproduced
    assert record.fp8
    assert {entry.calls for entry in record.fp8} == {1}
    assert all(entry.amax is not None for entry in record.fp8)
    assert record.batch is not None
    assert record.batch.ids == [1, 2]
