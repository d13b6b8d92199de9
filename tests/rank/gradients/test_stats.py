"""The loss and gradient norms in every record (``StepRecord.stats``), single process.

The fp16 scaler runs on the CPU (float32 gradients, a real scale) on both transports: the
CPU's own, and the accelerators' stacked copy run on the CPU (``use_device_transport``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from helpers import Net, batch, count_host_reads, poison, repeated_shapes, use_device_transport

import ampscope
from ampscope.rank.capture.watch import WatchCapture
from ampscope.reporter.schema import StepRecord
from ampscope.reporter.spike_rule import SpikeRule

Factory = Callable[[Net], list[torch.optim.Optimizer]]
FAST_RULE = SpikeRule(window=10, min_window=4)
"""A rule that can fire after four iterations, so tests stay short."""


def _sgd(model: Net) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.01)]


def _fused_adam(model: Net) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.parameters(), lr=0.01, fused=True)]


def _two(model: Net) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SGD(model.emb.parameters(), lr=0.01),
        torch.optim.Adam([*model.body.parameters(), *model.head.parameters()], lr=0.01),
    ]


def _clip_norm_after_unscale(
    scaler: torch.amp.GradScaler | ampscope.GradWatch,
    model: Net,
    optimizers: list[torch.optim.Optimizer],
    steps: int,
    *,
    scale_input: dict[int, float] | None = None,
) -> tuple[list[float], list[float]]:
    """Train with ``clip_grad_norm_`` after ``unscale_`` (an infinite max: nothing clipped);
    returns the norms it returned and the losses."""
    norms, losses = [], []
    for step in range(steps):
        x = batch(step)
        loss = model(x) * (scale_input or {}).get(step, 1.0)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad()
    return norms, losses


def _stats(scaler: torch.amp.GradScaler | ampscope.GradWatch) -> list[StepRecord]:
    return scaler.telemetry.history()


@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("factory", [_sgd, _two, _fused_adam], ids=["sgd", "two", "fused"])
def test_scaler_grad_norm_is_clip_grad_norm_after_unscale(
    factory: Factory, device_transport: bool
) -> None:
    model = Net()
    optimizers = factory(model)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    if device_transport:
        use_device_transport(scaler)
    norms, losses = _clip_norm_after_unscale(scaler, model, optimizers, 6)
    records = _stats(scaler)
    assert [r.stats.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)
    assert [r.stats.loss for r in records] == pytest.approx(losses, rel=1e-6)
    assert all(r.stats.grad_norm_origin is None for r in records), "no origin tracking"
    assert all(r.stats.spikes == [] and r.stats.top_params == [] for r in records)
    scaler.close()


def test_fused_optimizer_norms_are_unscaled_without_unscale_call() -> None:
    """A fused optimizer's step checks its still scaled gradients (torch unscales inside
    the optimizer): the record's norm is divided by the scale all the same."""
    model = Net()
    (opt,) = _fused_adam(model)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
    expected = []
    for step in range(3):
        scaler.scale(model(batch(step))).backward()
        grads = [p.grad.detach() / scaler.get_scale() for p in model.parameters()]
        expected.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert [r.stats.grad_norm for r in _stats(scaler)] == pytest.approx(expected, rel=1e-5)
    scaler.close()


@pytest.mark.parametrize("read_on_host", [True, False], ids=["host", "device"])
def test_watch_grad_norm_is_clip_grad_norm(read_on_host: bool) -> None:
    model = Net()
    optimizers = _two(model)
    watch = ampscope.GradWatch(reporter=None)
    watch._ampscope_capture = WatchCapture("observe", read_on_host=read_on_host)
    norms, losses = _clip_norm_after_unscale(watch, model, optimizers, 5)
    records = _stats(watch)
    assert [r.stats.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)
    assert [r.stats.loss for r in records] == pytest.approx(losses, rel=1e-6)
    watch.close()


@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_loss_is_the_mean_over_accumulated_micro_batches(front_end: str) -> None:
    model = Net()
    (opt,) = _sgd(model)
    scaler: torch.amp.GradScaler | ampscope.GradWatch = (
        ampscope.GradScaler("cpu", reporter=None)
        if front_end == "scaler"
        else ampscope.GradWatch(reporter=None)
    )
    means = []
    for step in range(3):
        losses = []
        for micro in range(4):
            loss = model(batch(10 * step + micro))
            losses.append(loss.item())
            scaler.scale(loss / 4).backward()
        means.append(sum(losses) / 4 / 4)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert [r.stats.loss for r in _stats(scaler)] == pytest.approx(means, rel=1e-6)
    scaler.close()


@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
def test_overflow_records_none_and_stays_out_of_the_windows(device_transport: bool) -> None:
    model = Net()
    (opt,) = _sgd(model)
    scaler = ampscope.GradScaler("cpu", reporter=None)
    if device_transport:
        use_device_transport(scaler)
    for step in range(4):
        scaler.scale(model(batch(step))).backward()
        if step == 2:
            poison(model.body.weight)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    records = _stats(scaler)
    assert records[2].skipped
    assert (records[2].stats.loss, records[2].stats.grad_norm) == (None, None)
    assert records[2].stats.grad_norm_origin is None
    for record in (records[0], records[1], records[3]):
        assert record.stats.loss is not None
        assert record.stats.grad_norm is not None
    windows = scaler.telemetry._builder.stats
    assert len(windows.loss_window) == len(windows.grad_norm_window) == 3
    scaler.close()


@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_stats_false_records_none(front_end: str) -> None:
    model = Net()
    (opt,) = _sgd(model)
    scaler: torch.amp.GradScaler | ampscope.GradWatch = (
        ampscope.GradScaler("cpu", reporter=None, stats=False)
        if front_end == "scaler"
        else ampscope.GradWatch(reporter=None, stats=False)
    )
    _clip_norm_after_unscale(scaler, model, [opt], 3)
    assert [r.stats for r in _stats(scaler)] == [None, None, None]
    assert scaler._ampscope_stats is None
    scaler.close()


@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_a_spike_names_itself_and_the_top_parameters(
    front_end: str, device_transport: bool
) -> None:
    model = Net()
    optimizers = _two(model)
    if front_end == "scaler":
        scaler: torch.amp.GradScaler | ampscope.GradWatch = ampscope.GradScaler(
            "cpu", init_scale=2.0**8, reporter=None, spike_rule=FAST_RULE, top_k=3
        )
        if device_transport:
            use_device_transport(scaler)
    else:
        scaler = ampscope.GradWatch(reporter=None, spike_rule=FAST_RULE, top_k=3)
        scaler._ampscope_capture = WatchCapture("observe", read_on_host=not device_transport)
    scaler.attach(model)
    expected: dict[str, float] = {}

    def per_param(step: int) -> None:
        if step == 7:
            expected.update(
                {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
            )

    norms, _ = _clip_norm_after_unscale_with_hook(
        scaler, model, optimizers, 9, spike_at=7, hook=per_param
    )
    records = _stats(scaler)
    spiking = [i for i, r in enumerate(records) if r.stats.spikes]
    assert spiking == [7]
    assert records[7].stats.spikes == ["loss", "grad_norm"]
    assert records[7].stats.grad_norm == pytest.approx(norms[7], rel=1e-5)
    top = records[7].stats.top_params
    ranked = sorted(expected.items(), key=lambda item: -item[1])[:3]
    assert [p.name for p in top] == [name for name, _ in ranked]
    assert [p.norm for p in top] == pytest.approx([norm for _, norm in ranked], rel=1e-5)
    assert all(r.stats.top_params == [] for i, r in enumerate(records) if i != 7)
    scaler.close()


def _clip_norm_after_unscale_with_hook(
    scaler: torch.amp.GradScaler | ampscope.GradWatch,
    model: Net,
    optimizers: list[torch.optim.Optimizer],
    steps: int,
    *,
    spike_at: int,
    hook: Callable[[int], None],
) -> tuple[list[float], list[float]]:
    norms, losses = [], []
    for step in range(steps):
        # A steady loss, then one batch whose loss (and gradients) are 50x.
        loss = model(batch(0)) * (50.0 if step == spike_at else 1.0)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.unscale_(opt)
        hook(step)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad()
    return norms, losses


def test_stats_add_no_host_reads_to_a_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With stats on, a watch's training thread reads tensors exactly as often as with
    stats off (the scalers' ``test_no_extra_host_reads_on_clean_steps`` runs with stats
    on, against torch's stock scaler)."""
    reads = count_host_reads(monkeypatch)

    def reads_with(stats: bool) -> int:
        model = Net()
        optimizers = _two(model)
        watch = ampscope.GradWatch(reporter=None, run_id="no-reads", stats=stats)
        watch._ampscope_capture = WatchCapture("observe", read_on_host=False)
        watch.attach(model)
        reads["n"] = 0
        for step in range(4):
            watch.scale(model(batch(step))).backward()
            for opt in optimizers:
                watch.step(opt)
            watch.update()
        count = reads["n"]
        records = _stats(watch)
        assert all((r.stats is not None) == stats for r in records)
        watch.close()
        return count

    assert reads_with(stats=True) == reads_with(stats=False)


@pytest.mark.parametrize("device_transport", [False, True], ids=["host", "device"])
def test_float16_gradients_are_normed_in_float32(device_transport: bool) -> None:
    """fp16 gradients (a model cast to half; torch unscales those only for optimizers that
    step themselves, like fused Adam): the norms are taken in float32, so they neither
    round to float16 nor overflow at 65504, and divided by the scale (the fused check
    unscales nothing)."""
    model = Net(dtype=torch.float16)
    (opt,) = _fused_adam(model)
    scaler = ampscope.GradScaler("cpu", init_scale=8.0, reporter=None)
    if device_transport:
        use_device_transport(scaler)
    expected = []
    # Two clean iterations: the third overflows (fp16 Adam on this tiny model).
    for step in range(2):
        scaler.scale(model(batch(step))).backward()
        norms = [p.grad.float().norm() for p in model.parameters()]
        scaled = torch.linalg.vector_norm(torch.stack(norms)).item()
        expected.append(scaled / scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    records = _stats(scaler)
    assert all(r.setup.grad_dtype == "float16" for r in records)
    assert [r.skipped for r in records] == [False] * 2
    assert [r.stats.grad_norm for r in records] == pytest.approx(expected, rel=1e-5)
    scaler.close()


@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_a_clean_run_of_hundreds_of_iterations_flags_no_spike(front_end: str) -> None:
    """Real training, a new random batch every iteration: the loss and gradient norm are
    noisy but stable, and the rank's default rule (OLMo-core's plus the ratio guard)
    flags nothing."""
    model = Net()
    (opt,) = _sgd(model)
    scaler: torch.amp.GradScaler | ampscope.GradWatch = (
        ampscope.GradScaler("cpu", reporter=None, history=400)
        if front_end == "scaler"
        else ampscope.GradWatch(reporter=None, history=400)
    )
    for step in range(400):
        scaler.scale(model(batch(step))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    records = _stats(scaler)
    assert len(records) == 400
    losses = [r.stats.loss for r in records]
    assert max(losses) > 1.5 * min(losses), "the series must be noisy, not flat"
    assert [r.step for r in records if r.stats.spikes] == []
    scaler.close()


@pytest.mark.parametrize("front_end", ["scaler", "watch"])
def test_a_spike_names_the_top_parameters_among_stacked_gradients(front_end: str) -> None:
    """The CPU's stacked norms name a spike's parameters as the per-tensor norms do."""
    model = repeated_shapes()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    if front_end == "scaler":
        front: torch.amp.GradScaler | ampscope.GradWatch = ampscope.GradScaler(
            "cpu", init_scale=2.0**8, reporter=None, spike_rule=FAST_RULE, top_k=4
        )
    else:
        front = ampscope.GradWatch(reporter=None, spike_rule=FAST_RULE, top_k=4)
    front.attach(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    expected: dict[str, float] = {}
    for step in range(9):
        loss = model(x).square().mean() * (50.0 if step == 7 else 1.0)
        front.scale(loss).backward()
        front.unscale_(optimizer)
        if step == 7:
            expected = {n: p.grad.norm().item() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        front.step(optimizer)
        front.update()
        optimizer.zero_grad()
    records = _stats(front)
    assert [i for i, r in enumerate(records) if r.stats.spikes] == [7]
    ranked = sorted(expected.items(), key=lambda item: (-item[1], item[0]))[:4]
    top = records[7].stats.top_params
    assert [p.name for p in top] == [name for name, _ in ranked]
    assert [p.norm for p in top] == pytest.approx([norm for _, norm in ranked], rel=1e-5)
    front.close()
