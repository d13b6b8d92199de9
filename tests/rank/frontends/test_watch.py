"""GradWatch on one process: the three policies against the loop without a watch, records."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import ListSink, Net, poison
from helpers import batch as index_batch
from torch import nn

import ampscope
from ampscope.rank.capture.watch import WatchCapture
from ampscope.reporter.schema import StepRecord

STEPS = 6
OVERFLOW = 2
"""0-based iteration whose batch overflows to inf in the forward pass."""


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)


def batch(step: int, overflow: frozenset[int] = frozenset({OVERFLOW})) -> torch.Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    return x * 3e38 if step in overflow else x


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, except that NaN equals NaN whatever its bit pattern."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~nan].view(width), b[~nan].view(width))


def state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        same_bits(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for k in sa for n in sa[k]
    )


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    watch: Any,
    *,
    steps: int = STEPS,
    overflow: frozenset[int] = frozenset({OVERFLOW}),
    skip_at: frozenset[int] = frozenset(),
    clip: bool = False,
) -> list[bool]:
    """The training loop; ``watch=None`` is the loop without a watch, which leaves out
    the optimizer step at ``skip_at`` (the reference of a skipping watch)."""
    skipped = []
    for step in range(steps):
        loss = loss_of(model, batch(step, overflow))
        if watch is None:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step not in skip_at:
                opt.step()
        else:
            watch.scale(loss).backward()
            if clip:
                watch.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            watch.step(opt)
            watch.update()
            skipped.append(watch.last_step_skipped)
        opt.zero_grad()
    return skipped


def adam(model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01, **kwargs)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_opt", [sgd, adam, lambda m: adam(m, fused=True)])
def test_observe_is_bit_identical_also_on_nonfinite_iterations(
    dtype: torch.dtype, make_opt: Callable[[nn.Module], torch.optim.Optimizer]
) -> None:
    plain, watched = make_model(dtype), make_model(dtype)
    plain_opt, watched_opt = make_opt(plain), make_opt(watched)
    train(plain, plain_opt, None, clip=True)
    sink = ListSink()
    watch = ampscope.GradWatch(reporter=None, sinks=[sink])
    watch.attach(watched)
    assert train(watched, watched_opt, watch, clip=True) == [False] * STEPS
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert same_bits(a.detach(), b.detach())
    assert state_equal(plain_opt, watched_opt)
    watch.close()
    records = sink.records
    # From the overflow on, the weights hold inf/NaN and so do all later gradients.
    assert [r.found_inf_global for r in records] == [s >= OVERFLOW for s in range(STEPS)]
    assert [r.found_inf_local["cpu"] for r in records] == [s >= OVERFLOW for s in range(STEPS)]
    assert not any(r.skipped for r in records)
    last = records[-1].totals
    assert last.nonfinite_applied == STEPS - OVERFLOW
    assert last.first_nonfinite_applied is not None
    assert last.first_nonfinite_applied.step == OVERFLOW + 1
    assert last.first_nonfinite_applied.origin is None  # origin not tracked
    assert last.skipped_steps == 0
    assert watch.telemetry.snapshot().nonfinite_applied == STEPS - OVERFLOW
    assert records[OVERFLOW].setup.model_dump() == {
        "mode": "watch",
        "policy": "observe",
        "grad_dtype": str(dtype).removeprefix("torch."),
    }


def test_a_watch_record_has_no_scale() -> None:
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    model = make_model()
    train(model, sgd(model), watch, steps=SCALE_STEPS)
    watch.close()
    for record in sink.records:
        assert (record.scale_before, record.scale_after, record.growth_tracker) == (1.0, 1.0, 0)
        assert record.event == "none"
    totals = sink.records[-1].totals
    assert (totals.backoffs, totals.growths, totals.min_scale, totals.max_scale) == (
        0,
        0,
        None,
        None,
    )
    assert totals.aligned_scale is None  # past step 10: a scaler would hold one
    assert [r.step for r in sink.records] == list(range(1, SCALE_STEPS + 1))
    # Every record passes the exporter's strict validation of its JSON.
    for record in sink.records:
        assert StepRecord.model_validate_json(record.model_dump_json()) == record


SCALE_STEPS = 11


@pytest.mark.parametrize("make_opt", [sgd, adam, lambda m: adam(m, fused=True)])
def test_skip_equals_a_run_that_did_not_take_the_step(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
) -> None:
    overflow = frozenset({1, 4})
    reference, watched = make_model(), make_model()
    reference_opt, watched_opt = make_opt(reference), make_opt(watched)
    train(reference, reference_opt, None, overflow=frozenset(), skip_at=overflow)
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    watch.attach(watched)
    # The skipped iterations' batches overflow; the reference's are clean but unused.
    skipped = train(watched, watched_opt, watch, overflow=overflow)
    assert skipped == [s in overflow for s in range(STEPS)]
    for a, b in zip(reference.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state_equal(reference_opt, watched_opt)
    watch.close()
    assert [r.skipped for r in sink.records] == skipped
    assert [r.found_inf_global for r in sink.records] == skipped
    assert sink.records[-1].totals.skipped_steps == len(overflow)
    assert sink.records[-1].totals.nonfinite_applied == 0
    named = {p.name for p in sink.records[1].nonfinite_params}
    assert named == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_raise_stops_with_the_record_delivered_and_params_unchanged() -> None:
    delivered_at_raise: list[int] = []
    sink = ListSink()
    watch = ampscope.GradWatch("raise", reporter=None, sinks=[sink])
    model = make_model()
    watch.attach(model)
    opt = sgd(model)
    try:
        train(model, opt, watch)
    except ampscope.NonFiniteGradientsError as raised:
        delivered_at_raise.extend(r.step for r in sink.records)
        error = raised
    else:
        pytest.fail("no NonFiniteGradientsError")
    before = [p.detach().clone() for p in model.parameters()]
    assert error.step == OVERFLOW + 1
    assert delivered_at_raise == list(range(1, OVERFLOW + 2))
    assert sink.records[-1].found_inf_global
    assert sink.records[-1].skipped
    assert error.origin_ranks is None
    assert error.local_ranks == (0,)
    assert {name for _, name, _ in error.params} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    message = str(error)
    assert f"step {OVERFLOW + 1}" in message
    assert "0.weight" in message
    assert all(p.isfinite().all() for p in before), "the non-finite step was not applied"
    # A loop that catches the error and calls update(): the iteration is not closed twice.
    watch.update()
    watch.close()
    assert [r.step for r in sink.records] == list(range(1, OVERFLOW + 2))


def test_max_consecutive_skips_raises_at_the_nth() -> None:
    sink = ListSink()
    watch = ampscope.GradWatch("skip", max_consecutive_skips=3, reporter=None, sinks=[sink])
    model = make_model()
    opt = sgd(model)
    with pytest.raises(ampscope.NonFiniteGradientsError, match="3 consecutive") as raised:
        # Iterations 1 and 3, 4, 5 overflow: 1 alone is not consecutive enough.
        train(model, opt, watch, overflow=frozenset({1, 3, 4, 5}))
    assert raised.value.step == 6
    assert [r.skipped for r in sink.records] == [False, True, False, True, True, True]
    watch.close()


def test_sparse_and_mixed_dtype_gradients_are_checked_per_group() -> None:
    """A sparse embedding gradient (its stored values) and a bf16 head beside float32
    layers: the per-(device, dtype) path, as torch's unscale groups them."""
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])

    class Mixed(Net):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(self.body(self.emb(idx))).to(torch.bfloat16)
            return self.head(hidden).float().square().mean()

    model = Mixed(sparse=True)
    model.head.to(torch.bfloat16)
    watch.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(index_batch(step)).backward()
        if step == 1:
            poison(model.emb.weight)
        watch.step(opt)
        watch.update()
        opt.zero_grad()
    watch.close()
    assert [r.skipped for r in sink.records] == [False, True, False]
    assert [p.name for p in sink.records[1].nonfinite_params] == ["emb.weight"]
    assert sink.records[0].setup.grad_dtype == "bfloat16+float32"


def test_each_optimizer_is_decided_on_its_own_flag() -> None:
    """Two optimizers, as torch's scaler: the one whose gradients hold inf skips, the
    other steps; the record has both, and the iteration counts as skipped."""
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    model = make_model()
    watch.attach(model)
    first, second = model[0], model[2]
    opts = [
        torch.optim.SGD(first.parameters(), lr=0.1),
        torch.optim.SGD(second.parameters(), lr=0.1),
    ]
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batch(0, frozenset())).backward()
    poison(second.weight)
    for opt in opts:
        watch.step(opt)
    assert watch.last_step_skipped
    watch.update()
    watch.close()
    after = list(model.parameters())
    assert not torch.equal(before[0], after[0])  # the first optimizer stepped
    assert torch.equal(before[2], after[2])  # the second skipped
    record = sink.records[0]
    assert [(o.index, o.found_inf) for o in record.optimizers] == [(0, False), (1, True)]
    assert record.skipped
    assert record.found_inf_local == {"cpu": True}
    assert [p.name for p in record.nonfinite_params] == ["2.weight"]


def test_scaler_protocol_and_errors() -> None:
    watch = ampscope.GradWatch(reporter=None)
    loss = torch.ones((), requires_grad=True)
    assert watch.scale(loss) is loss
    assert watch.get_scale() == 1.0
    assert watch.is_enabled()
    model = make_model()
    opt = sgd(model)
    loss_of(model, batch(0)).backward()
    watch.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        watch.unscale_(opt)
    watch.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        watch.step(opt)
    with pytest.raises(ValueError, match="no scale"):
        watch.update(2.0)
    watch.update()
    assert watch.state_dict() == {"consecutive_skips": 0}
    watch.load_state_dict({"consecutive_skips": 2})
    assert watch.state_dict() == {"consecutive_skips": 2}
    with pytest.raises(ValueError, match="loss scaler"):
        watch.load_state_dict(torch.amp.GradScaler("cpu").state_dict() | {"scale": 1.0})
    watch.close()
    with pytest.raises(ValueError, match="policy must be one of"):
        ampscope.GradWatch("ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="applies to policy 'skip'"):
        ampscope.GradWatch("observe", max_consecutive_skips=2)
    with pytest.raises(ValueError, match="positive"):
        ampscope.GradWatch("skip", max_consecutive_skips=0)


def test_a_pickled_watch_keeps_its_policy_without_sinks() -> None:
    import pickle

    sink = ListSink()
    watch = ampscope.GradWatch("skip", max_consecutive_skips=4, reporter=None, sinks=[sink])
    watch.load_state_dict({"consecutive_skips": 1})
    copy = pickle.loads(pickle.dumps(watch))
    watch.close()
    model = make_model()
    assert train(model, sgd(model), copy) == [s == OVERFLOW for s in range(STEPS)]
    assert copy.state_dict() == {"consecutive_skips": 0}
    # Its records stay in its own history: sinks and reporter do not travel.
    assert [r.skipped for r in copy.telemetry.history()] == [s == OVERFLOW for s in range(STEPS)]
    assert sink.records == []
    copy.close()


def test_a_failing_check_never_breaks_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampscope.rank import compat

    def broken(*args: object) -> None:
        raise RuntimeError("kernel unavailable")

    monkeypatch.setattr(compat, "non_finite_check_", broken)
    plain, watched = make_model(), make_model()
    train(plain, sgd(plain), None, overflow=frozenset())
    # Without stats: with them, clean CPU iterations are decided by the norms alone.
    watch = ampscope.GradWatch("skip", reporter=None, stats=False)
    assert train(watched, sgd(watched), watch, overflow=frozenset()) == [False] * STEPS
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert watch._ampscope_errors == STEPS  # counted; logged once
    watch.close()


def test_on_the_cpu_finite_norms_spare_the_kernel_and_overflowing_norms_flag_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ampscope.rank import compat

    kernel, calls = compat.non_finite_check_, []

    def counted(grads: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
        calls.append(len(grads))
        kernel(grads, found, one)

    monkeypatch.setattr(compat, "non_finite_check_", counted)
    sink = ListSink()
    watch = ampscope.GradWatch("skip", reporter=None, sinks=[sink])
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.0)
    # Clean; finite but its float32 norm overflows; inf; NaN.
    for grad in ([1.0, 2.0, 2.0], [1e20, 0.0, 0.0], [math.inf, 0.0, 0.0], [math.nan, 0.0, 0.0]):
        param.grad = torch.tensor(grad)
        watch.step(opt)
        watch.update()
    watch.close()
    assert calls == [1, 1, 1]  # the clean iteration was decided by its finite norm
    records = sink.records
    assert [r.found_inf_local["cpu"] for r in records] == [False, False, True, True]
    assert [r.skipped for r in records] == [False, False, True, True]
    stats = [r.stats for r in records]
    assert stats[0] is not None
    assert stats[0].grad_norm == 3.0
    assert stats[1] is not None
    assert stats[1].grad_norm is None  # its norm is not finite


def test_disabled_watch_is_a_pass_through() -> None:
    sink = ListSink()
    watch = ampscope.GradWatch("raise", enabled=False, reporter=None, sinks=[sink])
    model, plain = make_model(), make_model()
    train(plain, sgd(plain), None)
    train(model, sgd(model), watch)  # overflows, and raise does nothing when disabled
    watch.close()
    assert sink.records == []
    assert watch.state_dict() == {}
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert same_bits(a.detach(), b.detach())


def test_device_transport_gives_the_same_records() -> None:
    records = []
    for read_on_host in (True, False):
        sink = ListSink()
        watch = ampscope.GradWatch("skip", run_id="transport", reporter=None, sinks=[sink])
        watch._ampscope_capture = WatchCapture("skip", read_on_host=read_on_host)
        model = make_model()
        train(model, sgd(model), watch)
        watch.close()
        records.append([r.model_dump(exclude={"time"}) for r in sink.records])
    assert records[0] == records[1]
    assert [r["skipped"] for r in records[1]] == [s == OVERFLOW for s in range(STEPS)]


def _accelerator_path(watch: ampscope.GradWatch) -> None:
    """The device transport (the flags named at ``step()``, after any clip, not at the
    check), and the norms stacked on the training thread, as on an accelerator."""
    watch._ampscope_capture = WatchCapture(watch.policy, read_on_host=False)
    assert watch._ampscope_stats is not None
    watch._ampscope_stats.pack_on_cpu = True


@pytest.mark.parametrize("transport", ["host", "device"])
@pytest.mark.parametrize("clip", ["torch", "front-end"])
def test_a_clip_before_step_does_not_spread_the_naming(clip: str, transport: str) -> None:
    """The documented loop: ``unscale_()`` (the check), the clip, ``step()``. One NaN makes
    the clip's total NaN, and the clip multiplies every gradient by it. The record names
    the one parameter that held it: on the host transport counted at the check, on the
    device transport at ``step()`` (under ``skip``, once the agreed flag is read), kept to
    the parameters whose norm, taken before the clip, was not finite."""
    watch = ampscope.GradWatch("skip", reporter=None)
    if transport == "device":
        _accelerator_path(watch)
    model = Net()
    watch.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ if clip == "torch" else watch.clip_grad_norm_
    for step in range(4):
        watch.scale(model(index_batch(step))).backward()
        if step == 2:
            poison(model.body.bias, float("nan"))
        watch.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)
        if step == 2:
            assert all(p.grad is not None and p.grad.isnan().all() for p in model.parameters())
        watch.step(opt)
        watch.update()
        opt.zero_grad()
    history = watch.telemetry.history()
    assert [record.skipped for record in history] == [False, False, True, False]
    assert [p.name for p in history[2].nonfinite_params] == ["body.bias"]
    if transport == "host":  # the device transport's count is the clipped gradient's
        assert [p.count for p in history[2].nonfinite_params] == [1]
    else:
        assert [p.count for p in history[2].nonfinite_params] == [6]
    watch.close()


@pytest.mark.parametrize("transport", ["host", "device"])
def test_a_rank_whose_gradients_were_finite_names_nothing_after_the_clip(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Another rank's NaN: the agreement says skip, and the clip's total, summed over the
    ranks (FSDP1, FSDP2), multiplies this rank's gradients into NaN too. This rank's
    gradients were finite at its check: it names none of them. (The agreement's result is
    faked to play the other rank.)"""
    import ampscope.rank.frontends.watch as watch_module

    real = watch_module.agree
    other_rank_found = {"now": False}

    def agree(*args: Any, **kwargs: Any) -> torch.Tensor:
        flag = real(*args, **kwargs)
        return torch.ones_like(flag) if other_rank_found["now"] else flag

    monkeypatch.setattr(watch_module, "agree", agree)
    watch = ampscope.GradWatch("skip", reporter=None)
    if transport == "device":
        _accelerator_path(watch)
    model = Net()
    watch.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        watch.scale(model(index_batch(step))).backward()
        other_rank_found["now"] = step == 1
        watch.unscale_(opt)
        other_rank_found["now"] = False
        if step == 1:  # the clip's NaN total reaches every rank's gradients
            for param in model.parameters():
                assert param.grad is not None
                param.grad.mul_(float("nan"))
        watch.step(opt)
        watch.update()
        opt.zero_grad()
    history = watch.telemetry.history()
    assert [record.skipped for record in history] == [False, True, False]
    assert not history[1].found_inf_local["cpu"]
    assert history[1].nonfinite_params == []
    watch.close()


def test_scaler_records_say_scaler() -> None:
    sink = ListSink()
    scaler = ampscope.GradScaler("cpu", reporter=None, sinks=[sink])
    model = make_model()
    opt = sgd(model)
    for step in range(2):
        scaler.scale(loss_of(model, batch(step, frozenset()))).backward()
        scaler.step(opt)
        scaler.update()
    scaler.close()
    assert sink.records[-1].setup.model_dump() == {
        "mode": "scaler",
        "policy": "skip",
        "grad_dtype": "float32",
    }
    assert sink.records[-1].totals.nonfinite_applied == 0
    assert sink.records[-1].totals.first_nonfinite_applied is None


def test_lazy_exports() -> None:
    from ampscope.rank import GradWatch, NonFiniteGradientsError

    assert ampscope.GradWatch is GradWatch
    assert ampscope.NonFiniteGradientsError is NonFiniteGradientsError
    assert issubclass(NonFiniteGradientsError, RuntimeError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clean_iterations_add_no_sync() -> None:
    """observe (any optimizer) and skip with a fused optimizer never make the host wait:
    the flags stay on the device, a fused Adam takes the agreed one as ``found_inf``."""
    inject = 3
    # On the device before any sync check: copying a pageable CPU tensor to the GPU is a
    # sync of its own, which the debug mode rightly reports (the harness's, not the watch's).
    batches = [
        torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).cuda()
        for step in range(inject + 2)
    ]

    def cuda_train(watch: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for step in range(steps):
            x = batches[step]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            (loss if watch is None else watch.scale(loss)).backward()
            if step == inject:
                # fill_ of a slice: an item assignment would copy a host scalar (a sync).
                next(model.parameters()).grad.view(-1)[:1].fill_(float("inf"))
            if watch is None:
                if step != inject:
                    opt.step()
            else:
                watch.step(opt)
                watch.update()
            opt.zero_grad()

    results = {}
    for policy, fused in (("observe", False), ("skip", True)):
        sink = ListSink()
        watch = ampscope.GradWatch(policy, reporter=None, sinks=[sink])  # type: ignore[arg-type]
        model = make_model().cuda()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        cuda_train(watch, model, opt, 1)  # first iteration: allocations, identity
        torch.cuda.set_sync_debug_mode("error")
        try:
            cuda_train(watch, model, opt, inject + 2)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        watch.close()
        results[policy] = (model, sink.records)
    _, observed = results["observe"]
    assert [r.found_inf_local for r in observed[1 : inject + 2]] == [{"cuda:0": False}] * inject + [
        {"cuda:0": True}
    ]
    assert observed[-1].totals.nonfinite_applied == 2
    skipper, skipped = results["skip"]
    assert [r.skipped for r in skipped] == [s == inject + 1 for s in range(inject + 3)]
    reference = make_model().cuda()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, fused=True)
    cuda_train(None, reference, ref_opt, 1)
    cuda_train(None, reference, ref_opt, inject + 2)
    for a, b in zip(reference.parameters(), skipper.parameters(), strict=True):
        assert torch.equal(a, b)


def test_raise_hands_the_record_to_the_exporter_before_raising() -> None:
    from reporter.loopback_server import LoopbackExporter

    from ampscope.reporter.http import HttpReporter

    with LoopbackExporter() as server:
        # A long flush interval: only the watch's flush can send the record this soon.
        reporter = HttpReporter(server.url, flush_interval=60.0)
        watch = ampscope.GradWatch("raise", reporter=reporter, run_id="raise-test")
        model = make_model()
        arrived: list[int] = []
        try:
            train(model, sgd(model), watch)
        except ampscope.NonFiniteGradientsError:
            arrived = server.steps()
        watch.close()
    assert arrived == list(range(1, OVERFLOW + 2))


def test_a_raise_the_loop_catches_still_ends_the_rank_failed() -> None:
    from reporter.loopback_server import LoopbackExporter

    from ampscope.reporter.http import HttpReporter

    with LoopbackExporter() as server:
        watch = ampscope.GradWatch("raise", reporter=HttpReporter(server.url), run_id="stop")
        model = make_model()
        with pytest.raises(ampscope.NonFiniteGradientsError) as raised:
            train(model, sgd(model), watch)
        # The loop caught it, logged it and ends: the rank ends failed all the same.
        watch.close()
        final = server.heartbeats[-1]
    assert final.final
    assert final.failure is not None
    assert (final.failure.kind, final.failure.exception) == (
        "nonfinite_gradients",
        "NonFiniteGradientsError",
    )
    assert (final.failure.step, final.failure.seen_by) == (OVERFLOW + 1, "watch")
    assert final.failure.origin_ranks is None  # origin not tracked
    assert final.failure.message == str(raised.value)


def test_a_watch_as_a_context_manager_ends_the_rank_finished_or_failed() -> None:
    from reporter.loopback_server import LoopbackExporter

    from ampscope.reporter.http import HttpReporter

    with LoopbackExporter() as server:
        with ampscope.GradWatch(reporter=HttpReporter(server.url), run_id="ok") as watch:
            model = make_model()
            train(model, sgd(model), watch, overflow=frozenset())
        assert server.heartbeats[-1].final
        assert server.heartbeats[-1].failure is None
        oom = ampscope.GradWatch(reporter=HttpReporter(server.url), run_id="oom")

        def two_steps_then_out_of_memory() -> None:
            with oom as watch:
                model = make_model()
                train(model, sgd(model), watch, steps=2, overflow=frozenset())
                raise MemoryError("out of memory")

        with pytest.raises(MemoryError, match="out of memory"):
            two_steps_then_out_of_memory()
        final = server.heartbeats[-1]
    assert final.identity.run == "oom"
    assert final.failure is not None
    assert (final.failure.exception, final.failure.message) == ("MemoryError", "out of memory")
    assert (final.failure.step, final.failure.seen_by) == (2, "with")
    assert oom.telemetry.closed
