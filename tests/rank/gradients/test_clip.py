"""A front-end's ``clip_grad_norm_``: torch's clip bit for bit, whose one pass over the
gradients also gives the record's norms (no second pass from the next iteration on)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import Net, batch, use_device_transport

import ampscope
from ampscope.rank import compat
from ampscope.rank.capture.watch import WatchCapture
from ampscope.reporter.spike_rule import SpikeRule

FAST_RULE = SpikeRule(window=10, min_window=4)


def _count_own_norms(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts ampscope's own norm passes (``compat.foreach_norm``; the clip's pass is
    ``compat.foreach_norm_typed``)."""
    calls = {"n": 0}
    own = compat.foreach_norm

    def counted(tensors: list[torch.Tensor], low_precision: bool) -> tuple[torch.Tensor, ...]:
        calls["n"] += 1
        return own(tensors, low_precision)

    monkeypatch.setattr(compat, "foreach_norm", counted)
    return calls


def _train(
    front: object,
    model: Net,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    clip: object,
    max_norm: float,
    clip_at: set[int] | None = None,
    spike_at: int | None = None,
) -> list[torch.Tensor]:
    """Scaled steps with a clip after ``unscale_`` (on ``clip_at`` iterations, default
    all); returns the clip's totals."""
    totals = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(batch(step)) * (50.0 if step == spike_at else 1.0)
        front.scale(loss).backward()  # type: ignore[attr-defined]
        front.unscale_(opt)  # type: ignore[attr-defined]
        if clip_at is None or step in clip_at:
            totals.append(clip(model.parameters(), max_norm))  # type: ignore[operator]
        front.step(opt)  # type: ignore[attr-defined]
        front.update()  # type: ignore[attr-defined]
    return totals


@pytest.mark.parametrize("foreach", [None, False], ids=["kept", "torch-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clip_and_the_training_are_torchs_bit_for_bit(
    dtype: torch.dtype, foreach: bool | None
) -> None:
    """``foreach=False``: torch's per-tensor path, which the front-end leaves to torch."""
    stock_model = Net(dtype)
    model = copy.deepcopy(stock_model)
    stock_opt = torch.optim.SGD(stock_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stock = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    # A max_norm that clips: the clipped gradients are compared through the parameters.
    expected = _train(
        stock,
        stock_model,
        stock_opt,
        5,
        max_norm=0.05,
        clip=lambda p, m: torch.nn.utils.clip_grad_norm_(p, m, foreach=foreach),
    )
    totals = _train(
        scaler,
        model,
        opt,
        5,
        max_norm=0.05,
        clip=lambda p, m: scaler.clip_grad_norm_(p, m, foreach=foreach),
    )
    assert all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(expected, totals, strict=True)
    )
    for mine, theirs in zip(model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    records = scaler.telemetry.history()
    assert [r.stats.grad_norm for r in records] == pytest.approx(
        [t.item() for t in totals], rel=1e-2 if dtype == torch.bfloat16 else 1e-6
    )
    scaler.close()


@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
def test_after_the_first_clip_the_norms_are_the_clips(
    monkeypatch: pytest.MonkeyPatch, device_transport: bool
) -> None:
    calls = _count_own_norms(monkeypatch)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    if device_transport:
        use_device_transport(scaler)
    per_step = []
    totals = []
    for step in range(6):
        before = calls["n"]
        totals += _train(scaler, model, opt, 1, clip=scaler.clip_grad_norm_, max_norm=math.inf)
        per_step.append(calls["n"] - before)
        del step
    # The first iteration norms at unscale_ (no clip seen yet); the rest take the clip's.
    assert per_step == [1, 0, 0, 0, 0, 0]
    records = scaler.telemetry.history()
    assert [r.stats.grad_norm for r in records] == pytest.approx(
        [t.item() for t in totals], rel=1e-6
    )
    scaler.close()


def test_an_iteration_without_the_clip_norms_at_step_before_the_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    seen: list[float] = []
    # Recorded at step 2 (no clip): the unclipped gradients' norm, read before SGD moves.
    original_step = opt.step

    def step_and_note(*args: object, **kwargs: object) -> object:
        grads = [p.grad for p in model.parameters()]
        seen.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return original_step(*args, **kwargs)

    monkeypatch.setattr(opt, "step", step_and_note)
    calls = _count_own_norms(monkeypatch)
    _train(scaler, model, opt, 5, clip=scaler.clip_grad_norm_, max_norm=0.01, clip_at={0, 1, 3, 4})
    records = scaler.telemetry.history()
    assert records[2].stats.grad_norm == pytest.approx(seen[2], rel=1e-6)
    # Own passes: iteration 0 (unscale_), 2 (at step, deferred), 3 (unscale_: 2 had no clip).
    assert calls["n"] == 3
    scaler.close()


def test_a_clip_over_other_parameters_leaves_the_norms_their_own() -> None:
    """Clipping only part of the model: the record's norm is still every gradient's,
    taken before that clip changed them."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    expected = []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(model(batch(step))).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters()]
        expected.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        scaler.clip_grad_norm_(model.body.parameters(), 1e-4)
        scaler.step(opt)
        scaler.update()
    records = scaler.telemetry.history()
    assert [r.stats.grad_norm for r in records] == pytest.approx(expected, rel=1e-6)
    scaler.close()


@pytest.mark.parametrize(
    ("clip", "packed"), [(True, False), (False, True)], ids=["clip", "stacked-at-unscale"]
)
@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_a_spike_names_the_same_top_parameters_through_the_clip(
    front_end: str, device_transport: bool, clip: bool, packed: bool
) -> None:
    """Through the clip, or with the norms stacked as soon as they are taken (as on
    accelerators), the spike's attribution is the one the separate norms give."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    front: ampscope.GradScaler | ampscope.GradWatch
    if front_end == "scaler":
        front = ampscope.GradScaler(
            "cpu", init_scale=2.0**8, reporter=None, spike_rule=FAST_RULE, top_k=3
        )
        if device_transport:
            use_device_transport(front)
    else:
        front = ampscope.GradWatch(reporter=None, spike_rule=FAST_RULE, top_k=3)
        front._ampscope_capture = WatchCapture("observe", read_on_host=not device_transport)
    front.attach(model)
    assert front._ampscope_stats is not None
    front._ampscope_stats.pack_on_cpu = packed
    expected: dict[str, float] = {}
    totals = []
    for step in range(9):
        opt.zero_grad()
        loss = model(batch(0)) * (50.0 if step == 7 else 1.0)
        front.scale(loss).backward()
        front.unscale_(opt)
        if step == 7:
            expected = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        clip_grad_norm_ = front.clip_grad_norm_ if clip else torch.nn.utils.clip_grad_norm_
        totals.append(clip_grad_norm_(model.parameters(), math.inf).item())
        front.step(opt)
        front.update()
    records = front.telemetry.history()
    assert [i for i, r in enumerate(records) if r.stats.spikes] == [7]
    assert records[7].stats.grad_norm == pytest.approx(totals[7], rel=1e-6)
    ranked = sorted(expected.items(), key=lambda item: -item[1])[:3]
    top = records[7].stats.top_params
    assert [p.name for p in top] == [name for name, _ in ranked]
    assert [p.norm for p in top] == pytest.approx([norm for _, norm in ranked], rel=1e-5)
    front.close()


def test_a_clip_that_keeps_no_norms_takes_the_deferred_ones_before_clipping() -> None:
    """After clipped iterations, one whose clip takes torch's general path
    (``foreach=False``): the norms left to it are the unclipped gradients'."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    expected = []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(model(batch(step))).backward()
        scaler.unscale_(opt)
        norms = torch.stack([p.grad.norm() for p in model.parameters()])
        expected.append(torch.linalg.vector_norm(norms).item())
        scaler.clip_grad_norm_(model.parameters(), 1e-4, foreach=False if step == 2 else None)
        scaler.step(opt)
        scaler.update()
    records = scaler.telemetry.history()
    assert [r.stats.grad_norm for r in records] == pytest.approx(expected, rel=1e-6)
    scaler.close()
