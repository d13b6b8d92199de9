"""Origin tracking: the non-finite check itself, and the hooks in real gloo process groups.

Each distributed test is one 2-rank launch that does many checks, because a launch
costs seconds and the CI budget is shared.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import pytest
import torch
from support import run_distributed
from torch import nn

from ampscope.rank.gradients.origin import OriginFlags
from ampscope.rank.gradients.origin_hooks import install_origin_hooks

INF = math.inf
NAN = math.nan


def _values(flags: dict[str, torch.Tensor]) -> dict[str, float]:
    return {device: flag.item() for device, flag in flags.items()}


# --- the check ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "dtype", "expected"),
    [
        ([1.0, NAN, 2.0], torch.float32, 1.0),
        ([NAN, 1.0], torch.float16, 1.0),  # NaN first: max must not drop it
        ([1.0, NAN], torch.bfloat16, 1.0),
        ([1.0, INF], torch.float32, 1.0),
        ([-INF, 1.0], torch.float16, 1.0),
        ([65504.0, -65504.0] * 512, torch.float16, 0.0),  # largest finite fp16
        ([3.0e38, 3.0e38, -3.0e38], torch.float32, 0.0),  # a sum would overflow here
        ([3.3e38, 3.3e38], torch.bfloat16, 0.0),
        ([0.0, -0.0, 1e-45], torch.float32, 0.0),
    ],
)
@pytest.mark.parametrize("norms", [False, True], ids=["check", "check-and-norm"])
def test_mark_flags_exactly_the_non_finite(
    values: list[float], dtype: torch.dtype, expected: float, norms: bool
):
    # With norms, a float16 bucket's norm is its check: the largest finite values must not
    # read as non-finite.
    flags = OriginFlags(norms=norms)
    tensor = torch.tensor(values, dtype=dtype)
    flags.mark(tensor, factor=2.0)
    taken = flags.take()
    assert list(taken) == ["cpu"]
    assert taken["cpu"].dtype == torch.float32
    assert taken["cpu"].shape == (1,)
    assert taken["cpu"].item() == expected
    if norms and dtype == torch.float16 and not expected:
        (square,) = flags.take_squares().values()
        exact = 4.0 * sum(float(v) ** 2 for v in tensor.tolist())
        assert square.item() == pytest.approx(exact, rel=1e-6)


def test_mark_reads_a_strided_view_and_accumulates_until_take():
    flags = OriginFlags()
    grid = torch.zeros(4, 6)
    grid[3, 1] = INF
    flags.mark(grid[:, ::2])  # column 1 not in view: clean
    assert _values(flags.take()) == {"cpu": 0.0}
    flags.mark(grid.t())
    flags.mark(torch.ones(3))  # a later clean bucket must not clear the detection
    assert _values(flags.take()) == {"cpu": 1.0}
    # Restarted at 0, and the known device is still reported on a clean iteration.
    assert _values(flags.take()) == {"cpu": 0.0}


def test_take_before_any_mark_is_empty_and_ignored_tensors_create_no_flag():
    flags = OriginFlags()
    flags.mark(torch.empty(0))
    flags.mark(torch.tensor([1, 2, 3]))
    flags.mark(torch.sparse_coo_tensor([[0]], [INF], (2,), check_invariants=True))
    assert flags.take() == {}
    assert flags.errors == 0


def test_take_returns_the_flags_the_marks_wrote_then_new_tensors():
    flags = OriginFlags()
    flags.mark(torch.tensor([NAN]))
    first = flags.take()["cpu"]
    flags.mark(torch.tensor([1.0]))
    second = flags.take()["cpu"]
    assert first.item() == 1.0
    assert second.item() == 0.0
    assert second.data_ptr() != first.data_ptr()


def test_concurrent_marks_from_many_threads_lose_no_detection():
    flags = OriginFlags()
    clean = torch.ones(10_000)
    bad = torch.ones(10_000)
    bad[-1] = NAN
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        barrier.wait()
        for round_ in range(200):
            flags.mark(bad if (index, round_) == (5, 150) else clean)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _values(flags.take()) == {"cpu": 1.0}


class _Exploding(torch.Tensor):
    """A tensor whose every torch operation fails, to reach mark()'s error path."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError("boom")


def test_mark_never_raises_counts_errors_and_warns_once():
    flags = OriginFlags()
    broken = torch.ones(3).as_subclass(_Exploding)
    with pytest.warns(RuntimeWarning, match="boom"):
        flags.mark(broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags.mark(broken)  # second failure: counted, not warned again
    assert flags.errors == 2


def test_plain_module_is_rejected_with_the_reason():
    with pytest.raises(TypeError, match="runs no gradient collective"):
        install_origin_hooks(nn.Linear(2, 2), OriginFlags())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mark_and_take_never_sync_with_the_host_on_cuda():
    flags = OriginFlags()
    grad = torch.ones(1 << 20, device="cuda", dtype=torch.float16)
    grad[123] = INF
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flags.mark(grad)
        taken = flags.take()
        flags.mark(grad[:100])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flags.errors == 0
    assert _values(taken) == {"cuda:0": 1.0}
    assert _values(flags.take()) == {"cuda:0": 0.0}


# --- inside real collectives ---------------------------------------------------------


def _batch(rank: int, step: int, bad_rank: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 5, generator=gen) * (rank + 1)
    if rank == bad_rank:
        x[1, 2] = INF
    return x


def _net(seed: int = 0) -> nn.Sequential:
    # Odd sizes so that FSDP pads its flat gradients, which the check must not trip on.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _origin_per_step(model: nn.Module, flags: OriginFlags, rank: int, plan: list[Any]) -> list[Any]:
    """Backward once per entry of ``plan`` (the bad rank or None); flags taken after each."""
    seen = []
    for step, bad_rank in enumerate(plan):
        model(_batch(rank, step, bad_rank)).sum().backward()
        seen.append(_values(flags.take()))
        model.zero_grad(set_to_none=True)
    return seen


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(_batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _flat_params(model)


def _flat_params(model: nn.Module) -> list[list[float]]:
    from torch.distributed.tensor import DTensor

    full = (p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters())
    return [t.reshape(-1).tolist() for t in full]


def _ddp_checks(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    # Numerics: the same training with and without the hook, bit for bit.
    plain = DDP(_net())
    hooked = DDP(_net())
    install_origin_hooks(hooked, OriginFlags())
    out["params_equal"] = _train(plain, rank) == _train(hooked, rank)

    flags = OriginFlags()
    model = DDP(_net())
    handle = install_origin_hooks(model, flags)
    out["kind"] = handle.kind
    out["steps"] = _origin_per_step(model, flags, rank, [None, 1, None, 0])
    # Bad step: the all-reduce spread the inf, so the post-reduction grads cannot tell.
    model(_batch(rank, 0, bad_rank=1)).sum().backward()
    out["reduced_grad_finite"] = all(bool(p.grad.isfinite().all()) for p in model.parameters())
    flags.take()
    model.zero_grad(set_to_none=True)

    # Gradient accumulation: the bad micro-batch is under no_sync; the sync step sees it.
    with model.no_sync():
        model(_batch(rank, 0, bad_rank=0)).sum().backward()
    out["after_no_sync"] = _values(flags.take())
    model(_batch(rank, 1)).sum().backward()
    out["sync_step"] = _values(flags.take())
    model.zero_grad(set_to_none=True)

    # remove(): the hook stays (DDP cannot unregister) but stops checking; reinstall reuses it.
    handle.remove()
    out["after_remove"] = _origin_per_step(model, flags, rank, [1])
    again = OriginFlags()
    install_origin_hooks(model, again)
    out["reinstalled"] = _origin_per_step(model, again, rank, [1])
    with pytest.raises(ValueError, match="another scaler"):
        install_origin_hooks(model, OriginFlags())

    user = DDP(_net())
    user.register_comm_hook(None, _user_ddp_hook)
    with pytest.raises(ValueError, match=r"already has a comm hook \(_user_ddp_hook\)"):
        install_origin_hooks(user, OriginFlags())
    builtin = DDP(_net())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(ValueError, match="refused the origin comm hook"):
        install_origin_hooks(builtin, OriginFlags())
    return out


def _user_ddp_hook(state, bucket):  # unannotated: DDP compares annotations to real classes
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_ddp_origin_names_only_the_bad_rank_and_keeps_numerics():
    results = run_distributed(_ddp_checks)
    for rank, out in enumerate(results):
        assert out["params_equal"], f"rank {rank}: DDP with the origin hook trained differently"
        assert out["kind"] == "ddp"
        other = 1.0 if rank == 1 else 0.0
        assert out["steps"] == [{"cpu": 0.0}, {"cpu": other}, {"cpu": 0.0}, {"cpu": 1.0 - other}]
        assert out["reduced_grad_finite"] is False
        assert out["after_no_sync"] == {"cpu": 0.0}
        assert out["sync_step"] == {"cpu": 1.0 if rank == 0 else 0.0}
        assert out["after_remove"] == [{"cpu": 0.0}]
        assert out["reinstalled"] == [{"cpu": other}]


def _fsdp1_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(strategy: ShardingStrategy, mixed: MixedPrecision | None = None) -> FSDP:
        return FSDP(
            _net(),
            device_id=torch.device("cpu"),
            sharding_strategy=strategy,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),  # nested units share the hook
            mixed_precision=mixed,
            use_orig_params=True,
        )

    out: dict[str, Any] = {}
    cases = {
        "full_shard": (ShardingStrategy.FULL_SHARD, None),
        "no_shard": (ShardingStrategy.NO_SHARD, None),
        # reduce_dtype: FSDP casts before calling the hook, so the default hook sees fp16.
        "fp16_reduce": (ShardingStrategy.FULL_SHARD, MixedPrecision(reduce_dtype=torch.float16)),
    }
    for name, (strategy, mixed) in cases.items():
        hooked = wrap(strategy, mixed)
        install_origin_hooks(hooked, OriginFlags())
        out[f"{name}_params_equal"] = _train(wrap(strategy, mixed), rank) == _train(hooked, rank)
        flags = OriginFlags()
        model = wrap(strategy, mixed)
        handle = install_origin_hooks(model, flags)
        out[f"{name}_kind"] = handle.kind
        out[f"{name}_steps"] = _origin_per_step(model, flags, rank, [None, 1, None, 0])

    flags = OriginFlags()
    model = wrap(ShardingStrategy.FULL_SHARD)
    install_origin_hooks(model, flags)
    with model.no_sync():
        model(_batch(rank, 0, bad_rank=1)).sum().backward()
    out["after_no_sync"] = _values(flags.take())
    model(_batch(rank, 1)).sum().backward()
    out["sync_step"] = _values(flags.take())
    with pytest.raises(ValueError, match="another scaler"):
        install_origin_hooks(model, OriginFlags())

    user = wrap(ShardingStrategy.FULL_SHARD)
    user.register_comm_hook(None, _user_fsdp_hook)
    with pytest.raises(ValueError, match=r"already has a comm hook \(_user_fsdp_hook\)"):
        install_origin_hooks(user, OriginFlags())
    return out


def _user_fsdp_hook(state: object, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    raise AssertionError("never called")


@pytest.mark.distributed
def test_fsdp1_origin_names_only_the_bad_rank_and_keeps_numerics():
    results = run_distributed(_fsdp1_checks)
    for rank, out in enumerate(results):
        other = 1.0 if rank == 1 else 0.0
        for name in ("full_shard", "no_shard", "fp16_reduce"):
            assert out[f"{name}_params_equal"], f"rank {rank}: FSDP {name} trained differently"
            assert out[f"{name}_kind"] == "fsdp"
            assert out[f"{name}_steps"] == [
                {"cpu": 0.0},
                {"cpu": other},
                {"cpu": 0.0},
                {"cpu": 1.0 - other},
            ], name
        assert out["after_no_sync"] == {}
        assert out["sync_step"] == {"cpu": other}


class _NanPaddedReduceScatter:
    """A user comm whose buffers start as NaN: the check must only see what FSDP wrote."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self.default = DefaultReduceScatter()
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(tuple(size), NAN, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.default(*args, **kwargs)


def _fully_shard_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ampscope.rank.compat import fully_shard_param_groups, param_group_reduce_scatter
    from ampscope.rank.gradients.origin_hooks import OriginReduceScatter

    mesh = init_device_mesh("cpu", (world_size,))

    def shard(mp: MixedPrecisionPolicy | None = None) -> nn.Module:
        net = _net()
        kwargs: dict[str, Any] = {"mesh": mesh}
        if mp is not None:
            kwargs["mp_policy"] = mp
        fully_shard(net[0], **kwargs)
        fully_shard(net, **kwargs)
        return net

    def comms(net: nn.Module) -> list[Any]:
        return [param_group_reduce_scatter(g) for g in fully_shard_param_groups(net)]  # type: ignore[arg-type]

    out: dict[str, Any] = {}
    for name, mp in (
        ("fp32", None),
        ("fp16_reduce", MixedPrecisionPolicy(reduce_dtype=torch.float16)),
    ):
        hooked = shard(mp)
        install_origin_hooks(hooked, OriginFlags())
        out[f"{name}_params_equal"] = _train(shard(mp), rank) == _train(hooked, rank)

    flags = OriginFlags()
    model = shard()
    defaults = comms(model) + comms(model[0])
    handle = install_origin_hooks(model, flags)
    out["kind"] = handle.kind
    out["wrapped"] = all(isinstance(c, OriginReduceScatter) for c in comms(model) + comms(model[0]))
    out["steps"] = _origin_per_step(model, flags, rank, [None, 1, None, 0])

    model.set_requires_gradient_sync(False)
    model(_batch(rank, 0, bad_rank=1)).sum().backward()
    out["after_no_sync"] = _values(flags.take())
    model.set_requires_gradient_sync(True)
    model(_batch(rank, 1)).sum().backward()
    out["sync_step"] = _values(flags.take())
    model.zero_grad(set_to_none=True)

    with pytest.raises(ValueError, match="already installed"):
        install_origin_hooks(model, OriginFlags())
    handle.remove()
    out["restored"] = comms(model) + comms(model[0]) == defaults
    out["after_remove"] = _origin_per_step(model, flags, rank, [1])

    # A user's comm is wrapped, not replaced; NaN-initialised buffers prove the check
    # reads only what FSDP copied in (padding included: 7 rows over 2 ranks).
    nan_comm = _NanPaddedReduceScatter()
    model = shard()
    for module in (model, model[0]):
        module.set_custom_reduce_scatter(nan_comm)  # type: ignore[operator]
    flags = OriginFlags()
    install_origin_hooks(model, flags)
    out["user_comm_steps"] = _origin_per_step(model, flags, rank, [None, 0])
    out["user_comm_calls"] = nan_comm.calls
    return out


@pytest.mark.distributed
def test_fully_shard_origin_names_only_the_bad_rank_and_keeps_numerics():
    results = run_distributed(_fully_shard_checks)
    for rank, out in enumerate(results):
        other = 1.0 if rank == 1 else 0.0
        assert out["fp32_params_equal"], f"rank {rank}: fully_shard trained differently"
        assert out["fp16_reduce_params_equal"], f"rank {rank}: fp16 reduce trained differently"
        assert out["kind"] == "fully_shard"
        assert out["wrapped"] is True
        assert out["steps"] == [{"cpu": 0.0}, {"cpu": other}, {"cpu": 0.0}, {"cpu": 1.0 - other}]
        assert out["after_no_sync"] == {"cpu": 0.0}
        assert out["sync_step"] == {"cpu": other}
        assert out["restored"] is True
        assert out["after_remove"] == [{"cpu": 0.0}]
        assert out["user_comm_steps"] == [{"cpu": 0.0}, {"cpu": 1.0 - other}]
        assert out["user_comm_calls"] == 4  # 2 modules x 2 backward passes


# --- end to end through the scalers --------------------------------------------------


def _scaler_records(scaler: Any, model: nn.Module, rank: int, plan: list[Any]) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.attach(model, track_origin=True)
    for step, bad_rank in enumerate(plan):
        scaler.scale(model(_batch(rank, step, bad_rank)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    records = scaler.telemetry.history()
    scaler.close()
    return [
        (r.found_inf_origin, r.found_inf_global, r.skipped, r.totals.found_inf_origin)
        for r in records
    ]


def _scaler_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ampscope import GradScaler, ShardedGradScaler

    plan = [None, 1, None, 0]
    options: dict[str, Any] = {"reporter": None, "run_id": "origin-e2e", "init_scale": 2.0**4}
    fully = _net()
    fully_shard(fully, mesh=init_device_mesh("cpu", (world_size,)))
    models = {
        "ddp": (GradScaler("cpu", **options), DDP(_net())),
        "fsdp": (ShardedGradScaler("cpu", **options), FSDP(_net(), device_id=torch.device("cpu"))),
        "fully_shard": (GradScaler("cpu", **options), fully),
    }
    return {name: _scaler_records(s, m, rank, plan) for name, (s, m) in models.items()}


@pytest.mark.distributed
def test_scaler_records_name_only_the_bad_rank_as_origin():
    results = run_distributed(_scaler_checks)
    for rank, out in enumerate(results):
        mine = [False, rank == 1, False, rank == 0]
        for name, records in out.items():
            assert [origin for origin, *_ in records] == [{"cpu": bad} for bad in mine], name
            # Every rank skipped the bad steps: the reduction spread the inf everywhere.
            assert [(g, s) for _, g, s, _ in records] == [(b, b) for b in (False, True) * 2], name
            assert records[-1][3] == {"cpu": 1}, name


def _ops(run: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for event in prof.events() if event.cpu_parent is None)


@pytest.mark.parametrize("buckets", [3, 150])
def test_a_bucket_costs_two_ops_and_a_take_the_same_whatever_the_buckets(buckets: int):
    """On a GPU each op is a kernel launch: a mark launches the check and the norm into its
    slot, and take() makes the flag and squared norm in a fixed number, so the per-bucket
    cost does not grow with what the flag needs (more than one buffer's worth included)."""
    flags = OriginFlags(norms=True)
    tensors = [torch.randn(64) for _ in range(buckets)]
    for tensor in tensors:  # first iteration: the buffers
        flags.mark(tensor)
    flags.take(), flags.take_squares()
    assert _ops(lambda: [flags.mark(t) for t in tensors]) == 2 * buckets
    take_ops = _ops(lambda: (flags.take(), flags.take_squares()))
    # Past one buffer (64 buckets), one concatenation each for the extrema and the norms.
    assert take_ops == 9 + (2 if buckets > 64 else 0)


def test_a_mark_that_fails_after_claiming_its_slot_leaves_no_stale_value(
    monkeypatch: pytest.MonkeyPatch,
):
    """A check that fails once its slot is claimed: no flag from the slot's old contents
    (the previous iteration's NaN bucket), and the norm is unknown rather than stale."""
    flags = OriginFlags(norms=True)
    flags.mark(torch.tensor([NAN, 50.0]))
    assert _values(flags.take()) == {"cpu": 1.0}
    flags.take_squares()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no kernel")

    monkeypatch.setattr(torch, "aminmax", broken)
    with pytest.warns(RuntimeWarning, match="no kernel"):
        flags.mark(torch.ones(4))
    assert flags.errors == 1
    assert _values(flags.take()) == {"cpu": 0.0}
    (square,) = flags.take_squares().values()
    assert math.isnan(square.item())


def test_float64_buckets_are_normed_and_float8_ones_counted_as_errors():
    flags = OriginFlags(norms=True)
    flags.mark(torch.full((4,), 3.0, dtype=torch.float64))
    assert _values(flags.take()) == {"cpu": 0.0}
    assert flags.take_squares()["cpu"].item() == pytest.approx(36.0)
    with pytest.warns(RuntimeWarning, match="float8"):
        flags.mark(torch.ones(4).to(torch.float8_e4m3fn))
    assert flags.errors == 1
    assert _values(flags.take()) == {"cpu": 0.0}  # take() still reads every slot
