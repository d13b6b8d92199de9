"""Single-process behaviour: numerics equal torch's, torch's API and errors preserved."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ListSink, Net, batch, count_host_reads, poison, run, use_device_transport
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import ampscope
from ampscope.rank import compat

INJECT = {3, 7, 8}
Factory = Callable[[Net], list[torch.optim.Optimizer]]


def _sgd(model: Net) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


def _fused_adam(model: Net) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.parameters(), lr=0.01, fused=True)]


def _two(model: Net) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SGD([*model.emb.parameters(), *model.body.parameters()], lr=0.1),
        torch.optim.AdamW(model.head.parameters(), lr=0.01),
    ]


def _inject_head(model: Net, step: int) -> None:
    if step in INJECT:
        poison(model.head.weight)


def _side_by_side(
    factory: Factory,
    *,
    dtype: torch.dtype = torch.float32,
    sparse: bool = False,
    clip: bool = False,
    steps: int = 12,
    transport: str = "host",
) -> tuple[ampscope.GradScaler, ListSink, list[float]]:
    """Train ours and torch's side by side; assert equal params and scales."""
    sink = ListSink()
    ours = ampscope.GradScaler(
        "cpu", init_scale=256.0, growth_interval=2, reporter=None, sinks=[sink]
    )
    if transport == "device":
        use_device_transport(ours)
    stock = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    ours_model, stock_model = Net(dtype, sparse), Net(dtype, sparse)
    ours.attach(ours_model)
    ours_scales = run(ours, ours_model, factory(ours_model), steps, inject=_inject_head, clip=clip)
    stock_scales = run(
        stock, stock_model, factory(stock_model), steps, inject=_inject_head, clip=clip
    )
    assert ours_scales == stock_scales
    for a, b in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(ours_model.parameters(), Net(dtype).parameters(), strict=True)
    )
    ours.close()
    return ours, sink, ours_scales


@pytest.mark.parametrize(
    ("factory", "dtype", "sparse", "clip"),
    [
        pytest.param(_sgd, torch.float32, False, False, id="sgd-fp32"),
        pytest.param(_sgd, torch.bfloat16, False, False, id="sgd-bf16-grads"),
        pytest.param(_sgd, torch.float32, True, False, id="sparse-embedding"),
        pytest.param(_sgd, torch.float32, False, True, id="unscale-then-clip"),
        pytest.param(_fused_adam, torch.float32, False, False, id="fused-adam"),
        pytest.param(_fused_adam, torch.float16, False, False, id="fused-adam-fp16-grads"),
        pytest.param(_two, torch.float32, False, False, id="two-optimizers"),
    ],
)
@pytest.mark.parametrize("transport", ["host", "device"])
def test_parity_and_records(
    factory: Factory, dtype: torch.dtype, sparse: bool, clip: bool, transport: str
) -> None:
    """Both ways a step's values reach the telemetry thread give the same records: read at
    update() (CPU) and copied for later (accelerators; forced here on the CPU)."""
    ours, sink, scales = _side_by_side(
        factory, dtype=dtype, sparse=sparse, clip=clip, transport=transport
    )
    records = sink.records
    # torch's scale shrinks exactly on the iterations it skipped: the injected ones, and
    # with fp16 gradients also natural overflows.
    pairs = list(zip([256.0, *scales], scales, strict=False))
    skips = [after < before for before, after in pairs]
    growths = sum(after > before for before, after in pairs)
    assert {step for step, skipped in enumerate(skips) if skipped} >= INJECT
    assert (sum(skips) == len(INJECT)) == (dtype != torch.float16)
    assert [r.step for r in records] == list(range(1, 13))
    assert [r.skipped for r in records] == skips
    assert [r.scale_after for r in records] == scales
    assert [r.event == "backoff" for r in records] == skips
    assert [r.event == "growth" for r in records] == [a > b for b, a in pairs]
    snap = ours.telemetry.snapshot()
    assert (snap.steps, snap.skipped_steps, snap.backoffs) == (12, sum(skips), sum(skips))
    assert snap.growths == growths > 0
    assert snap.found_inf_local == {"cpu": sum(skips)}
    assert snap.scale == scales[-1]
    assert snap.last == records[-1]
    assert records[-1].totals.skipped_steps == sum(skips)
    fused = factory is _fused_adam
    assert all(d.fused == fused for r in records for d in r.optimizers if d.name == "Adam")
    for step, record in enumerate(records):
        named = {p.name: p.count for p in record.nonfinite_params}
        if step in INJECT and dtype != torch.float16:
            assert named == {"head.weight": 1}
        elif step in INJECT:
            assert named["head.weight"] >= 1
        assert bool(named) == record.skipped
    assert sink.threads == {"ampscope-telemetry"}, "sinks run on ampscope's thread"
    if factory is _two:
        # Only the optimizer owning the poisoned grad skipped; update() still backs off.
        assert [(d.name, d.found_inf) for d in records[3].optimizers] == [
            ("SGD", False),
            ("AdamW", True),
        ]


def _inject_body(model: Net, step: int) -> None:
    if step in INJECT:
        poison(model.body.bias)


def _frozen_embedding(model: Net) -> list[torch.optim.Optimizer]:
    model.emb.weight.requires_grad_(False)  # its gradient stays None
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


def _float64_head(model: Net) -> list[torch.optim.Optimizer]:
    torch.manual_seed(11)  # two dtypes: torch unscales two groups
    model.head = torch.nn.Sequential(_Float64(), torch.nn.Linear(6, 2, dtype=torch.float64))
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


class _Float64(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


@pytest.mark.parametrize(
    ("factory", "sparse", "one_group"),
    [
        pytest.param(_sgd, False, True, id="one-group"),
        pytest.param(_two, False, True, id="two-optimizers"),
        pytest.param(_sgd, True, False, id="sparse"),
        pytest.param(_frozen_embedding, False, False, id="a-gradient-missing"),
        pytest.param(_float64_head, False, False, id="two-dtypes"),
    ],
)
@pytest.mark.parametrize("how", ["step", "unscale_"])
def test_the_unscale_walks_no_parameter_where_torch_makes_one_group(
    monkeypatch: pytest.MonkeyPatch, factory: Factory, sparse: bool, one_group: bool, how: str
) -> None:
    """Where every gradient is present and dense on one device and dtype, the scaler runs
    torch's unscale kernel on the gradients itself, without torch's walk over the
    parameters in Python (some 500 ns a parameter); anywhere else torch's own walk runs.
    Either way the weights, the scales and what update() read are torch's, bit for bit."""
    if sparse and how == "unscale_":
        pytest.skip("torch's clip_grad_norm_ takes no sparse gradient")
    lean = {"n": 0}
    original = compat.unscale_one_group_

    def unscaled(*args: Any) -> Any:
        lean["n"] += 1
        return original(*args)

    monkeypatch.setattr(compat, "unscale_one_group_", unscaled)
    ours = ampscope.GradScaler("cpu", init_scale=256.0, growth_interval=2, reporter=None)
    stock = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    ours_model, stock_model = Net(sparse=sparse), Net(sparse=sparse)
    ours.attach(ours_model)
    ours_opts, stock_opts = factory(ours_model), factory(stock_model)
    clip = how == "unscale_"
    ours_scales = run(ours, ours_model, ours_opts, 8, inject=_inject_body, clip=clip)
    stock_scales = run(stock, stock_model, stock_opts, 8, inject=_inject_body, clip=clip)
    assert ours_scales == stock_scales
    assert [r.skipped for r in ours.telemetry.history()] == [
        after < before for before, after in zip([256.0, *stock_scales], stock_scales, strict=False)
    ]
    for a, b in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert lean["n"] == (8 * len(ours_opts) if one_group else 0)
    ours.close()


def test_a_model_converted_to_fp16_after_its_first_steps_is_refused_like_torch() -> None:
    """The shortcut's one device and dtype are learnt at the optimizer's first unscale; a
    model converted since (``half()``) changes its gradients' dtype, and the scaler must
    then refuse them as torch's does, not unscale them."""
    for scaler in (torch.amp.GradScaler("cpu"), ampscope.GradScaler("cpu", reporter=None)):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run(scaler, model, [opt], 2)
        model.half()
        scaler.scale(model(batch(2))).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.unscale_(opt)
        if isinstance(scaler, ampscope.GradScaler):
            scaler.close()


def test_a_patch_of_torchs_unscale_is_called_as_by_torchs_scaler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A patch of ``torch.amp.GradScaler._unscale_grads_``, made before or after the scaler
    was built, runs as it runs under torch's own scaler: the shortcut steps aside."""
    calls: list[int] = []
    original = torch.amp.GradScaler._unscale_grads_

    def patched(self: Any, *args: Any) -> Any:
        calls.append(id(self))
        return original(self, *args)

    before = ampscope.GradScaler("cpu", reporter=None)
    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", patched)
    after = ampscope.GradScaler("cpu", reporter=None)
    stock = torch.amp.GradScaler("cpu")
    for scaler in (before, after, stock):
        model = Net()
        run(scaler, model, [torch.optim.SGD(model.parameters(), lr=0.1)], 2)
    assert calls == [id(before)] * 2 + [id(after)] * 2 + [id(stock)] * 2
    before.close()
    after.close()


def test_parameters_reordered_in_place_keep_their_norms_names() -> None:
    """The norms take the unscale's list of gradients only while the optimizer holds the
    plan's parameters in the plan's order. Reordered in place, each norm keeps its name:
    on an accelerator the parameters a skipped step names are those whose norm before the
    clip was inf/NaN (the device transport, forced here on the CPU)."""
    scaler = ampscope.GradScaler("cpu", reporter=None)
    _accelerator_path(scaler)
    model = Net()
    scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["params"].reverse()
        scaler.scale(model(batch(step))).backward()
        if step == 2:
            poison(model.head.weight, float("nan"))  # not the middle of 5: moved by a reverse
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    history = scaler.telemetry.history()
    assert [record.skipped for record in history] == [False, False, True, False]
    assert [p.name for p in history[2].nonfinite_params] == ["head.weight"]
    scaler.close()


def test_a_parameter_replaced_in_the_optimizer_is_unscaled_like_torch() -> None:
    """An optimizer whose parameter list had one entry replaced in place (same length, a
    new tensor) is unscaled over the parameters it holds now, as torch's scaler unscales
    them, not over those it held when the norms were planned (whose gradients, kept as
    zeros by ``zero_grad(set_to_none=False)``, are still there)."""
    weights = []
    for scaler in (torch.amp.GradScaler("cpu"), ampscope.GradScaler("cpu", reporter=None)):
        model = Net()
        if isinstance(scaler, ampscope.GradScaler):
            scaler.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2:
                index = next(
                    i for i, p in enumerate(opt.param_groups[0]["params"]) if p is model.head.weight
                )
                model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
                opt.param_groups[0]["params"][index] = model.head.weight
            scaler.scale(model(batch(step))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
        weights.append([p.detach().clone() for p in model.parameters()])
    for ours, stock in zip(weights[1], weights[0], strict=True):
        assert torch.equal(ours, stock)


def test_fp16_grads_rejected_like_torch() -> None:
    """torch.amp.GradScaler refuses to unscale fp16 gradients for ordinary optimizers."""
    for scaler in (torch.amp.GradScaler("cpu"), ampscope.GradScaler("cpu", reporter=None)):
        model = Net(torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(batch(0))).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.step(opt)


def test_last_step_skipped_and_attribution_off() -> None:
    scaler = ampscope.GradScaler("cpu", reporter=None, attribution=False)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(4):
        scaler.scale(model(batch(step))).backward()
        if step == 2:
            poison(model.body.bias, float("nan"))
        scaler.step(opt)
        seen.append(scaler.last_step_skipped)  # between step() and update()
        scaler.update()
        seen.append(scaler.last_step_skipped)  # after update()
        opt.zero_grad()
    assert seen == [False, False, False, False, True, True, False, False]
    history = scaler.telemetry.history()
    assert history[2].skipped
    assert history[2].nonfinite_params == []
    scaler.close()


@pytest.mark.parametrize("transport", ["host", "device"])
@pytest.mark.parametrize("clip", ["torch", "front-end"])
def test_a_clip_before_step_does_not_spread_the_naming(clip: str, transport: str) -> None:
    """A loop that clips between ``unscale_()`` and ``step()`` (the Trainer, Accelerate,
    Lightning): one NaN makes the clip's total NaN, and the clip multiplies every gradient
    by a NaN coefficient. The record must still name the one parameter that held it: on
    the host transport counted at the unscale, on the device transport (the accelerators')
    by the norms taken before the clip."""
    scaler = ampscope.GradScaler("cpu", reporter=None)
    if transport == "device":
        _accelerator_path(scaler)
    model = Net()
    scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ if clip == "torch" else scaler.clip_grad_norm_
    for step in range(4):
        scaler.scale(model(batch(step))).backward()
        if step == 2:
            poison(model.body.bias, float("nan"))
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)
        if step == 2:
            assert all(p.grad is not None and p.grad.isnan().all() for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    history = scaler.telemetry.history()
    assert [record.skipped for record in history] == [False, False, True, False]
    named = [p.name for p in history[2].nonfinite_params]
    assert named == ["body.bias"]
    if transport == "host":  # the device transport's count is the clipped gradient's
        assert [p.count for p in history[2].nonfinite_params] == [1]
    scaler.close()


def _accelerator_path(scaler: torch.amp.GradScaler) -> None:
    """The device transport, and the norms stacked on the training thread as on an
    accelerator."""
    use_device_transport(scaler)
    scaler._ampscope_stats.pack_on_cpu = True  # type: ignore[attr-defined]


@pytest.mark.parametrize("transport", ["host", "device"])
def test_a_sharded_rank_whose_gradients_were_finite_names_nothing_after_the_clip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, transport: str
) -> None:
    """FSDP1: another rank's NaN reaches this rank's found-inf only in the all-reduce after
    its unscale, and FSDP's clip then multiplies this rank's gradients by the NaN total
    too. This rank's gradients were finite at its unscale: it names none of them. (One
    gloo rank; the all-reduce of the flag plays the other rank's NaN.)"""
    import torch.distributed as dist
    import torch.distributed.fsdp.sharded_grad_scaler as sharded

    real = dist.all_reduce
    other_rank_found = {"now": False}

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if other_rank_found["now"] and tensor.numel() == 1:
            tensor.fill_(1.0)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(sharded.dist, "all_reduce", all_reduce)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        scaler = ampscope.ShardedGradScaler("cpu", reporter=None)
        if transport == "device":  # named at update(), after the clip, by the norms
            _accelerator_path(scaler)
        model = Net()
        scaler.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            scaler.scale(model(batch(step))).backward()
            other_rank_found["now"] = step == 1
            scaler.unscale_(opt)
            other_rank_found["now"] = False
            if step == 1:  # FSDP's clip: the NaN total reaches every rank's gradients
                for param in model.parameters():
                    assert param.grad is not None
                    param.grad.mul_(float("nan"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        history = scaler.telemetry.history()
        assert [record.skipped for record in history] == [False, True, False]
        assert history[1].nonfinite_params == []
        scaler.close()
    finally:
        dist.destroy_process_group()


def _misuse(scaler: torch.amp.GradScaler) -> list[str]:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []

    def attempt(fn: Callable[[], object]) -> None:
        try:
            fn()
            messages.append("no error")
        except (RuntimeError, AssertionError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")

    attempt(scaler.update)  # before any scale()
    scaler.scale(model(batch(0))).backward()
    attempt(scaler.update)  # no inf checks recorded
    scaler.unscale_(opt)
    attempt(lambda: scaler.unscale_(opt))
    attempt(lambda: scaler.step(opt, closure=lambda: 0.0))
    scaler.step(opt)
    attempt(lambda: scaler.step(opt))
    attempt(lambda: scaler.unscale_(opt))
    scaler.update()
    return messages


def test_misuse_raises_like_torch() -> None:
    ours = _misuse(ampscope.GradScaler("cpu", reporter=None))
    assert ours == _misuse(torch.amp.GradScaler("cpu"))
    assert ours[0].startswith("AssertionError: Attempted update but _scale is None")
    assert ours[1] == "AssertionError: No inf checks were recorded prior to update."
    assert "unscale_() has already been called" in ours[2]
    assert "Closure use is not currently supported" in ours[3]
    assert "step() has already been called" in ours[4]
    assert "after step" in ours[5]


def test_state_dict_both_ways() -> None:
    ours = ampscope.GradScaler("cpu", init_scale=64.0, growth_interval=2, reporter=None)
    model = Net()
    run(ours, model, _sgd(model), 5, inject=lambda m, s: poison(m.head.bias) if s == 1 else None)
    stock = torch.amp.GradScaler("cpu")
    stock.load_state_dict(ours.state_dict())
    assert stock.state_dict() == ours.state_dict()
    assert ours.state_dict()["_growth_tracker"] == 1

    back = ampscope.GradScaler("cpu", reporter=None)
    back.load_state_dict(stock.state_dict())
    assert back.state_dict() == stock.state_dict()
    a, b = Net(), Net()
    assert run(back, a, _sgd(a), 4) == run(stock, b, _sgd(b), 4)
    ours.close()
    back.close()


def test_disabled_is_pass_through() -> None:
    sink = ListSink()
    before = {t.name for t in threading.enumerate()}
    scaler = ampscope.GradScaler("cpu", enabled=False, sinks=[sink])
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(batch(0))
    assert scaler.scale(loss) is loss
    loss.backward()
    assert scaler.step(opt) is None
    scaler.update()
    assert not scaler.is_enabled()
    assert scaler.state_dict() == {}
    assert scaler.get_scale() == 1.0
    assert not scaler.last_step_skipped
    assert scaler.telemetry.snapshot().steps == 0
    scaler.close()
    assert sink.records == []
    assert {t.name for t in threading.enumerate()} == before, "no threads when disabled"


def test_factor_accessors_and_pickle() -> None:
    scaler = ampscope.GradScaler("cpu", init_scale=8.0, growth_interval=3, reporter=None)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(5)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    assert scaler.get_growth_interval() == 5
    model = Net()
    run(scaler, model, _sgd(model), 2)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    assert clone.telemetry.snapshot().steps == 0, "telemetry does not travel in a pickle"
    run(clone, model, _sgd(model), 1)
    scaler.close()


@pytest.mark.parametrize("transport", ["host", "device"])
def test_scale_before_follows_every_change_of_the_scale(transport: str) -> None:
    """Each record's scale_before is the scale its update() started from, also after a
    clamp, a skipped step, load_state_dict() between iterations and a manual
    update(new_scale). The device transport takes it from the previous step's copy only
    while the scale tensor's version counter proves it unchanged."""
    sink = ListSink()
    scaler = ampscope.GradScaler(
        "cpu", init_scale=4.0, growth_interval=1, reporter=None, sinks=[sink], max_scale=32.0
    )
    if transport == "device":
        use_device_transport(scaler)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    started_from = []
    for step in range(12):
        scaler.scale(model(batch(step))).backward()
        if step == 5:
            poison(model.head.weight)
        scaler.step(opt)
        started_from.append(scaler.get_scale())
        scaler.update(64.0 if step == 8 else None)
        opt.zero_grad()
        if step == 3:
            scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0})
    scaler.close()
    records = sink.records
    assert [r.scale_before for r in records] == started_from
    assert started_from[4] == 1024.0, "load_state_dict() set the scale"
    assert started_from[9] == 64.0, "update(64.0) set the scale"
    clamped_halved_set = [8.0, 16.0, 32.0, 32.0, 32.0, 16.0, 32.0, 32.0, 64.0, 32.0, 32.0, 32.0]
    assert [r.scale_after for r in records] == clamped_halved_set
    assert [r.event for r in records].count("manual") == 1


@pytest.mark.parametrize("transport", ["host", "device"])
def test_skips_are_told_by_the_step_counter_alone(transport: str) -> None:
    """A step() the user calls outside the scaler does not hide a later skip, and an
    optimizer unscaled but not stepped is recorded as such, with its found-inf."""
    sink = ListSink()
    scaler = ampscope.GradScaler("cpu", init_scale=8.0, reporter=None, sinks=[sink])
    if transport == "device":
        use_device_transport(scaler)
    model = Net()
    first, second = _two(model)
    scaler.attach(model)
    model(batch(0)).backward()
    first.step()  # an unscaled warm-up step, outside the scaler
    first.zero_grad()
    scaler.scale(model(batch(1))).backward()
    poison(model.body.weight)
    scaler.step(first)
    scaler.step(second)
    skipped_now = scaler.last_step_skipped
    scaler.update()
    first.zero_grad()
    second.zero_grad()
    scaler.scale(model(batch(2))).backward()
    poison(model.head.weight)
    scaler.unscale_(first)
    scaler.unscale_(second)  # unscaled, never stepped
    scaler.step(first)
    scaler.update()
    scaler.close()
    skipped, partial = sink.records
    assert skipped_now
    assert skipped.skipped
    assert [(d.name, d.found_inf) for d in skipped.optimizers] == [("SGD", True), ("AdamW", False)]
    assert {p.name: p.count for p in skipped.nonfinite_params} == {"body.weight": 1}
    assert not partial.skipped, "the optimizer that stepped was clean"
    assert [(d.name, d.found_inf) for d in partial.optimizers] == [("SGD", False), ("AdamW", True)]
    assert partial.event == "backoff", "torch backs off for any found-inf"
    assert partial.nonfinite_params == [], "nothing was skipped, so nothing is counted"


def test_manual_update_and_clamp() -> None:
    scaler = ampscope.GradScaler(
        "cpu", init_scale=4.0, growth_interval=1, reporter=None, max_scale=16.0, min_scale=2.0
    )
    model = Net()
    opt = _sgd(model)
    scales = run(scaler, model, opt, 4)
    assert scales == [8.0, 16.0, 16.0, 16.0], "max_scale holds the scale"
    scaler.scale(model(batch(9))).backward()
    scaler.step(opt[0])
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0, "a manual scale is taken as given"
    inject = lambda m, s: poison(m.head.weight)  # noqa: E731
    scales = run(scaler, model, opt, 12, inject=inject)
    assert scales[-1] == 2.0, "min_scale holds the scale"
    events = [r.event for r in scaler.telemetry.history()]
    assert events[:5] == ["growth", "growth", "growth", "growth", "manual"]
    assert set(events[5:]) == {"backoff"}
    scaler.close()


def test_no_extra_host_reads_on_clean_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """On accelerators the training thread reads the device exactly as often as torch's
    scaler does. The device transport runs here on the CPU; the CPU's own transport reads
    host memory, which is not a device read."""
    reads = count_host_reads(monkeypatch)

    def reads_in(scaler: torch.amp.GradScaler, factory: Factory) -> int:
        model = Net()
        opts = factory(model)
        run(scaler, model, opts, 1)  # warm-up: first update() resolves the identity
        reads["n"] = 0
        for step in range(1, 4):
            scaler.scale(model(batch(step))).backward()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        return reads["n"]

    for factory in (_sgd, _two):
        stock = reads_in(torch.amp.GradScaler("cpu"), factory)
        ours_scaler = ampscope.GradScaler("cpu", reporter=None)
        use_device_transport(ours_scaler)
        assert reads_in(ours_scaler, factory) == stock > 0
        ours_scaler.close()


def test_sharded_scaler_single_process_without_group() -> None:
    """Constructor order and defaults match torch's ShardedGradScaler."""
    ours = ampscope.ShardedGradScaler("cpu", 32.0, 0.25, 4.0, 7, reporter=None)
    stock = TorchSharded("cpu", 32.0, 0.25, 4.0, 7)
    assert isinstance(ours, TorchSharded)
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval", "get_scale"):
        assert getattr(ours, getter)() == getattr(stock, getter)()
    assert isinstance(ampscope.GradScaler("cpu", reporter=None), torch.amp.GradScaler)
    ours.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parity_and_records() -> None:
    """On CUDA the step's scalars travel through pinned memory and an event."""
    sink = ListSink()
    ours = ampscope.GradScaler(
        "cuda", init_scale=256.0, growth_interval=2, reporter=None, sinks=[sink]
    )
    stock = torch.amp.GradScaler("cuda", init_scale=256.0, growth_interval=2)
    models = [Net().cuda(), Net().cuda()]
    ours.attach(models[0])
    scales = []
    for scaler, model in zip((ours, stock), models, strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trajectory = []
        for step in range(8):
            loss = model(batch(step).cuda())
            scaler.scale(loss).backward()
            _inject_head(model, step)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            trajectory.append(scaler.get_scale())
        scales.append(trajectory)
    assert scales[0] == scales[1]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    ours.close()
    assert [r.skipped for r in sink.records] == [s in INJECT for s in range(8)]
    assert [r.scale_after for r in sink.records] == scales[0]
    assert sink.records[3].found_inf_local == {"cuda:0": True}
    assert [p.name for p in sink.records[3].nonfinite_params] == ["head.weight"]
