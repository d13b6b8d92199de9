"""The DeepSpeed integration's own-gradient checks, without DeepSpeed: the per-parameter
hooks (``OwnGradientFlags``) are plain tensor hooks and the boundary check
(``BoundaryGradientFlags``) reads ``.grad``, so a plain model's backward exercises them; the
wraps of ``allreduce_gradients`` (ZeRO-0/1), ``reduce_ipg_grads`` (ZeRO-2) and the
name-mangled ``__reduce_and_partition_ipg_grads`` (ZeRO-3) on duck-typed engines."""

from __future__ import annotations

import math

import pytest
import torch
from support import HostReads
from torch import nn

from ampscope.integrations.deepspeed import reduction as ds
from ampscope.integrations.deepspeed.origin import (
    BoundaryGradientFlags,
    BucketGradientFlags,
    OwnGradientFlags,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _poison(param: nn.Parameter) -> torch.utils.hooks.RemovableHandle:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad

    return param.register_hook(hook)  # registered first: runs before the flags' hook


def test_a_clean_backward_flags_nothing() -> None:
    model = _model()
    flags = OwnGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward()
    assert flags.take() == ({"cpu": False}, {})


def test_a_nan_in_one_gradient_names_its_parameter_over_micro_batches() -> None:
    model = _model()
    _poison(model[1].weight)
    flags = OwnGradientFlags(model.named_parameters())
    for _ in range(2):  # accumulation: the flag of the first micro-batch is kept
        model(torch.randn(3, 4)).square().mean().backward()
    assert flags.take() == ({"cpu": True}, {"1.weight": 1})
    assert flags.take() == ({"cpu": False}, {}), "take() starts afresh"


@pytest.mark.parametrize("create_graph", [False, True])
def test_the_check_is_not_recorded_even_when_backward_builds_a_graph(
    create_graph: bool,
) -> None:
    """The hook runs its check without ``no_grad`` (which would cost as much as the kernel):
    with ``create_graph=True`` the check must still flag, record nothing into the
    gradients' graph, and leave that graph differentiable."""
    model = _model()
    _poison(model[0].bias)
    flags = OwnGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward(create_graph=create_graph)
    recorded = [
        node.name()
        for p in model.parameters()
        if p.grad is not None and p.grad.grad_fn is not None
        for node in [p.grad.grad_fn]
    ]
    assert not any("amp" in name.lower() for name in recorded), recorded
    assert flags.take() == ({"cpu": True}, {"0.bias": 1})
    assert flags.errors == 0
    if create_graph:
        weight = model[1].weight
        assert weight.grad is not None
        assert weight.grad.requires_grad
        weight.grad.sum().backward()  # the gradient's own graph still differentiates


def test_a_non_contiguous_gradient_is_read_not_written() -> None:
    param = nn.Parameter(torch.ones(3, 4))
    flags = OwnGradientFlags([("p", param)])
    grad = torch.full((4, 3), math.inf).t()  # not contiguous
    param.grad = None
    (param * 1.0).backward(grad)
    assert flags.take() == ({"cpu": True}, {"p": 1})


# -- BoundaryGradientFlags: one check before the boundary's reduction (ZeRO-0/1) ----------


def test_the_boundary_check_names_the_parameters_over_accumulated_micro_batches() -> None:
    model = _model()
    poison = _poison(model[1].weight)
    flags = BoundaryGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward()  # the NaN micro-batch
    poison.remove()
    model(torch.randn(3, 4)).square().mean().backward()  # a clean one, summed into .grad
    flags.check()
    assert flags.take() == ({"cpu": True}, {"1.weight": 1})
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, 4)).square().mean().backward()
    flags.check()
    assert flags.take() == ({"cpu": False}, {}), "take() starts afresh"


def test_the_boundary_check_leaves_the_gradients_as_they_were() -> None:
    model = _model()
    flags = BoundaryGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    versions = [p.grad._version for p in model.parameters() if p.grad is not None]
    flags.check()
    assert [p.grad._version for p in model.parameters() if p.grad is not None] == versions
    for grad, was in zip([p.grad for p in model.parameters()], before, strict=True):
        assert grad is not None
        assert torch.equal(grad, was)
    assert flags.take() == ({"cpu": False}, {})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_boundary_check_is_exact_for_large_finite_gradients(dtype: torch.dtype) -> None:
    """Huge but finite gradients are clean (a float32 sum of them would overflow; the check
    sums in float64), an inf or a NaN anywhere in a tensor is not."""
    big = torch.finfo(dtype).max
    params = {name: nn.Parameter(torch.zeros(1000, dtype=dtype)) for name in "abc"}
    flags = BoundaryGradientFlags(params.items())
    params["a"].grad = torch.full((1000,), big, dtype=dtype)
    params["b"].grad = torch.full((1000,), big, dtype=dtype)
    params["b"].grad[500] = -math.inf
    params["c"].grad = torch.zeros(1000, dtype=dtype)
    params["c"].grad[999] = math.nan
    flags.check()
    assert flags.take() == ({"cpu": True}, {"b": 1, "c": 1})


def test_the_boundary_check_runs_once_per_step_and_skips_absent_gradients() -> None:
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    flags = BoundaryGradientFlags([("used", used), ("unused", unused)])
    used.grad = torch.tensor([1.0, math.inf])
    flags.check()
    used.grad = torch.ones(2)  # reduced (and averaged) after the check: not read again
    flags.check_now()
    assert flags.take() == ({"cpu": True}, {"used": 1})
    flags.check_now()  # a step whose reduction did not check (no_sync): step() does
    assert flags.take() == ({"cpu": False}, {})
    assert flags.errors == 0


def test_a_failing_boundary_check_warns_once_and_never_raises() -> None:
    param = nn.Parameter(torch.ones(2))
    flags = BoundaryGradientFlags([("p", param)])
    param.grad = torch.ones(2).to_sparse()  # no multi-tensor norm for sparse gradients
    with pytest.warns(RuntimeWarning, match="could not check"):
        flags.check()
    flags.take()
    flags.check()
    assert flags.errors == 2


# -- the wrap of allreduce_gradients (read in deepspeed.reduction) -------------------------


class _Engine:
    """What check_before_reduction reads of a DeepSpeed engine."""

    def __init__(self) -> None:
        self.boundary = False
        self.reduced: list[bool] = []

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary

    def allreduce_gradients(self, bucket_size: int = 0) -> None:
        self.reduced.append(self.boundary)


def test_the_check_runs_before_the_reduction_at_a_boundary_only() -> None:
    engine = _Engine()
    calls: list[list[bool]] = []
    unwrap = ds.check_before_reduction(engine, lambda: calls.append(list(engine.reduced)))
    engine.allreduce_gradients()  # a micro-batch inside the step: no check
    engine.boundary = True
    engine.allreduce_gradients(bucket_size=7)
    assert calls == [[False]], "checked once, before the boundary's reduction"
    assert engine.reduced == [False, True]
    unwrap()
    unwrap()
    assert "allreduce_gradients" not in vars(engine)
    engine.allreduce_gradients()
    assert len(calls) == 1


def test_the_reduced_gradients_are_checked_right_after_the_boundary_reduction() -> None:
    engine = _Engine()
    before: list[list[bool]] = []
    after: list[list[bool]] = []
    ds.check_before_reduction(
        engine,
        lambda: before.append(list(engine.reduced)),
        lambda: after.append(list(engine.reduced)),
    )
    engine.allreduce_gradients()  # a micro-batch inside the step: neither check
    engine.boundary = True
    engine.allreduce_gradients()
    assert before == [[False]]
    assert after == [[False, True]], "once, after the boundary's reduction"


def test_flags_taken_on_the_device_are_named_from_their_host_values() -> None:
    """take_on_device() copies and zeroes without a read; name() reads the copy's host
    values (the monitor's telemetry thread) and says what take() says at once."""
    model = _model()
    flags = BoundaryGradientFlags(model.named_parameters())
    handle = _poison(model[1].weight)
    model(torch.randn(3, 4)).square().mean().backward()
    handle.remove()
    flags.check()
    with HostReads() as census:
        taken = flags.take_on_device()
    assert census.count == 0
    host = {device: vector.tolist() for device, vector in taken.items()}
    assert flags.name(host) == ({"cpu": True}, {"1.weight": 1})
    assert flags.take() == ({"cpu": False}, {}), "taken once, and zeroed"
    flags.check()  # a new step: the check runs again
    assert flags.take() == ({"cpu": True}, {"1.weight": 1})


def test_only_engines_that_reduce_at_the_boundary_are_checked_there() -> None:
    """A duck-typed engine: the attributes reduces_at_boundary_only reads (the real
    engines' answers per stage are asserted in test_deepspeed.py)."""

    class Zero(_Engine):
        enable_backward_allreduce = True

        def __init__(self, stage: int, optimizer: object) -> None:
            super().__init__()
            self.stage, self.optimizer = stage, optimizer

        def is_deepcompile_active(self) -> bool:
            return False

        def zero_optimization_partition_gradients(self) -> bool:
            return self.stage >= 2

        def zero_optimization_stage(self) -> int:
            return self.stage

    class DeepSpeedZeroOptimizer:
        def __init__(self, overlap_comm: bool, use_grad_accum_attribute: bool) -> None:
            self.overlap_comm = overlap_comm
            self.use_grad_accum_attribute = use_grad_accum_attribute

    class BF16Optimizer:
        fp32_groups_gradients = ()

    assert ds.reduces_at_boundary_only(Zero(0, object()))
    assert ds.reduces_at_boundary_only(Zero(1, DeepSpeedZeroOptimizer(False, False)))
    assert not ds.reduces_at_boundary_only(Zero(1, DeepSpeedZeroOptimizer(True, False)))
    assert not ds.reduces_at_boundary_only(Zero(1, DeepSpeedZeroOptimizer(False, True)))
    assert not ds.reduces_at_boundary_only(Zero(2, DeepSpeedZeroOptimizer(False, False)))
    assert not ds.reduces_at_boundary_only(Zero(0, BF16Optimizer()))
    assert not ds.reduces_at_boundary_only(_Engine()), "unrecognised: keep the hooks"


def test_the_boundary_check_groups_dtypes_and_keeps_each_name_on_its_slot() -> None:
    """Parameters of mixed dtypes are checked one dtype group at a time (sorted, each a
    slice of the device's flag vector): every name still lands on its own flag."""
    params = {
        "a16": nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)),
        "b32": nn.Parameter(torch.zeros(3)),
        "c16": nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)),
        "d32": nn.Parameter(torch.zeros(3)),
    }
    flags = BoundaryGradientFlags(params.items())
    for bad in params:
        for name, param in params.items():
            param.grad = torch.full_like(param, math.nan if name == bad else 1.0)
        flags.check()
        assert flags.take() == ({"cpu": True}, {bad: 1}), bad


# -- BucketGradientFlags: one check per gradient bucket (ZeRO-2) -------------------------


def _bucket_flags() -> tuple[BucketGradientFlags, dict[str, nn.Parameter]]:
    params = {name: nn.Parameter(torch.zeros(2)) for name in ("a", "b", "c", "d")}
    ids = {id(p): 10 + i for i, p in enumerate(params.values())}  # DeepSpeed's own numbering
    return BucketGradientFlags(params.items(), lambda p: ids[id(p)]), params


def test_a_bucket_check_names_its_parameters_by_deepspeed_id_over_micro_batches() -> None:
    flags, _ = _bucket_flags()
    clean, nan = torch.ones(2), torch.tensor([1.0, math.nan])
    flags.check([clean, nan], (13, 11))  # micro-batch 1, bucket 1: d clean, b NaN
    flags.check([clean, clean], (12, 10))  # bucket 2
    flags.check([clean, clean], (13, 11))  # micro-batch 2: same layout, clean
    flags.check([torch.tensor([math.inf, 0.0])], (12,))  # a new layout
    assert flags.take() == ({"cpu": True}, {"b": 1, "c": 1})
    flags.check([clean, clean], (13, 11))
    assert flags.take() == ({"cpu": False}, {}), "take() starts afresh"
    assert flags.errors == 0


def test_a_bucket_check_skips_parameters_that_are_not_the_modules() -> None:
    """An optimizer may hold parameters the engine's module does not name: their gradients
    are in the bucket, and only the module's are flagged."""
    flags, _ = _bucket_flags()
    nan = torch.tensor([math.nan, 0.0])
    flags.check([nan, torch.ones(2), nan], (99, 10, 11))
    assert flags.take() == ({"cpu": True}, {"b": 1})
    flags.check([nan], (99,))  # a bucket of none of the module's: nothing to flag
    assert flags.take() == ({"cpu": False}, {})
    assert flags.errors == 0


def test_a_bucket_check_that_fails_warns_once_and_never_raises() -> None:
    flags, _ = _bucket_flags()
    nan = torch.tensor([math.nan, 0.0])
    with pytest.warns(RuntimeWarning, match="could not check"):
        flags.check([nan], (10, 11))  # fewer gradients than ids
    flags.check([nan], (12, 13))
    assert flags.errors == 2
    assert flags.take() == ({"cpu": False}, {})


class _Bucket:
    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.params: list[tuple[int, int, int]] = []


class _ZeroOptimizer:
    """What check_each_bucket reads of a ZeRO-2 optimizer: its buckets per dtype and the
    method that reduces them (called with a dtype, or none for all)."""

    def __init__(self) -> None:
        self.ipg_buckets = {torch.bfloat16: _Bucket(), torch.float32: _Bucket()}
        self.reduced: list[object] = []

    def reduce_ipg_grads(self, comm_dtype: object = None) -> None:
        self.reduced.append(comm_dtype)
        for dtype, bucket in self.ipg_buckets.items():
            if comm_dtype in (None, dtype):
                bucket.grads.clear()
                bucket.params.clear()


def test_each_bucket_is_checked_before_its_reduction() -> None:
    engine = _Engine()
    optimizer = engine.optimizer = _ZeroOptimizer()  # type: ignore[attr-defined]
    seen: list[tuple[int, tuple[int, ...]]] = []
    unwrap = ds.check_each_bucket(engine, lambda grads, ids: seen.append((len(grads), ids)))
    half, full = optimizer.ipg_buckets[torch.bfloat16], optimizer.ipg_buckets[torch.float32]
    half.grads[:] = [torch.ones(1), torch.ones(1)]
    half.params[:] = [(0, 0, 5), (0, 1, 6)]
    full.grads[:] = [torch.ones(1)]
    full.params[:] = [(1, 0, 7)]
    optimizer.reduce_ipg_grads(comm_dtype=torch.bfloat16)  # a full bucket, during backward
    assert seen == [(2, (5, 6))]
    optimizer.reduce_ipg_grads()  # the epilogue: every bucket left (the empty one skipped)
    assert seen == [(2, (5, 6)), (1, (7,))]
    assert optimizer.reduced == [torch.bfloat16, None]
    unwrap()
    unwrap()
    assert "reduce_ipg_grads" not in vars(optimizer)


# -- ZeRO-3: one check per bucket before __reduce_and_partition_ipg_grads -------------------


class _Z3Bucket:
    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        self.elements = 0


class DeepSpeedZeroOptimizer_Stage3:  # DeepSpeed's name: it mangles the method
    """What the ZeRO-3 wrap reads of DeepSpeed's optimizer, and its bucket logic in small:
    the class's own calls go through ``self.__reduce_and_partition_ipg_grads`` (name-mangled
    with this class's name, as in DeepSpeed), which sets ``.grad`` to ``None`` once reduced."""

    def __init__(self, bucket_size: int) -> None:
        self.ipg_buckets = {torch.float32: _Z3Bucket()}
        self.bucket_size = bucket_size
        self.reduce_and_partition_stream = None  # DeepSpeed's CPU accelerator
        self.zenflow = False
        self.offload_optimizer = self.offload_param = self._coalesce_grad_reduction = False
        self.autoep_folding_tp_group = None
        self.reduced: list[tuple[int, ...]] = []

    def add(self, param: nn.Parameter) -> None:  # reduce_independent_p_g_buckets_and_remove_grads
        bucket = self.ipg_buckets[torch.float32]
        if bucket.elements + param.numel() > self.bucket_size and bucket.elements > 0:
            self.__reduce_and_partition_ipg_grads(torch.float32)
        bucket.params.append(param)
        bucket.elements += param.numel()

    def epilogue(self) -> None:  # independent_gradient_partition_epilogue
        for dtype in self.ipg_buckets:
            self.__reduce_and_partition_ipg_grads(dtype)

    def __reduce_and_partition_ipg_grads(self, communication_data_type: torch.dtype) -> None:
        bucket = self.ipg_buckets[communication_data_type]
        if not bucket.params:
            return
        self.reduced.append(tuple(p.ds_id for p in bucket.params))  # type: ignore[attr-defined]
        for param in bucket.params:
            param.grad = None  # partition_grads
        bucket.params.clear()
        bucket.elements = 0


class _Zero3Engine:
    def __init__(self, optimizer: object) -> None:
        self.optimizer = optimizer

    def zero_optimization_stage(self) -> int:
        return 3

    def is_deepcompile_active(self) -> bool:
        return False


def _zero3_params() -> dict[str, nn.Parameter]:
    params = {
        name: nn.Parameter(torch.zeros(size)) for name, size in (("a", 2), ("b", 5), ("c", 2))
    }
    for ds_id, param in enumerate(params.values(), start=20):
        param.ds_id = ds_id  # type: ignore[attr-defined]
    return params


def _backward(
    optimizer: DeepSpeedZeroOptimizer_Stage3, params: dict[str, nn.Parameter], bad: str
) -> None:
    """One micro-batch: each parameter's fresh gradient (``bad``'s NaN) reaches a bucket in
    backward order, then the end of backward flushes what is left."""
    for name in reversed(params):
        param = params[name]
        param.grad = torch.full_like(param, math.nan if name == bad else 1.0)
        optimizer.add(param)
    optimizer.epilogue()


def test_each_zero3_bucket_is_checked_before_its_reduction() -> None:
    """DeepSpeed's own (name-mangled) calls reach the wrap: the bucket flushed before an
    "extra large" gradient, that gradient's own bucket, the end-of-backward flush; each
    checked on its gradients before the reduction clears them, over two micro-batches."""
    params = _zero3_params()
    optimizer = DeepSpeedZeroOptimizer_Stage3(bucket_size=4)
    engine = _Zero3Engine(optimizer)
    assert ds.reduces_per_partition_bucket(engine, params.values())
    flags = BucketGradientFlags(params.items(), ds.partition_param_id)
    seen: list[tuple[tuple[int, ...], int]] = []

    def check(grads: list[torch.Tensor], ids: tuple[int, ...]) -> None:
        seen.append((ids, len(optimizer.reduced)))
        flags.check(grads, ids)

    unwrap = ds.check_each_partition_bucket(engine, check)
    _backward(optimizer, params, bad="b")  # b (5 elements) is larger than a bucket
    assert optimizer.reduced == [(22,), (21,), (20,)]
    assert seen == [((22,), 0), ((21,), 1), ((20,), 2)], "each checked before its reduction"
    _backward(optimizer, params, bad="")  # micro-batch 2: clean, flags keep micro-batch 1's
    assert flags.take() == ({"cpu": True}, {"b": 1})
    _backward(optimizer, params, bad="c")
    assert flags.take() == ({"cpu": True}, {"c": 1})
    assert flags.errors == 0
    unwrap()
    unwrap()
    assert ds._ZERO3_REDUCE not in vars(optimizer)
    _backward(optimizer, params, bad="a")
    assert len(seen) == 9, "unwrapped: DeepSpeed's method alone"
    assert flags.take() == ({"cpu": False}, {})


def test_a_zero3_bucket_check_never_writes_the_gradients() -> None:
    params = _zero3_params()
    optimizer = DeepSpeedZeroOptimizer_Stage3(bucket_size=100)
    engine = _Zero3Engine(optimizer)
    flags = BucketGradientFlags(params.items(), ds.partition_param_id)
    before: list[list[torch.Tensor]] = []

    def check(grads: list[torch.Tensor], ids: tuple[int, ...]) -> None:
        copies = [g.clone() for g in grads]
        versions = [g._version for g in grads]
        flags.check(grads, ids)
        assert [g._version for g in grads] == versions
        for grad, copy in zip(grads, copies, strict=True):
            torch.testing.assert_close(grad, copy, equal_nan=True)
        before.append(copies)

    ds.check_each_partition_bucket(engine, check)
    _backward(optimizer, params, bad="a")
    assert [len(grads) for grads in before] == [3], "one bucket of the three gradients"
    assert flags.take() == ({"cpu": True}, {"a": 1})


def test_only_recognised_zero3_optimizers_are_checked_per_bucket() -> None:
    """What reduces_per_partition_bucket refuses (the hooks instead): each a gradient path
    the bucket check would not see whole, or not before another rank's values."""
    params = _zero3_params()

    def recognised(**changes: object) -> bool:
        optimizer = DeepSpeedZeroOptimizer_Stage3(bucket_size=4)
        for name, value in changes.items():
            setattr(optimizer, name, value)
        return ds.reduces_per_partition_bucket(_Zero3Engine(optimizer), params.values())

    assert recognised()
    assert not recognised(offload_optimizer=True)
    assert not recognised(offload_param=True)
    assert not recognised(zenflow=True)
    assert not recognised(autoep_folding_tp_group=object()), "all-reduced before the bucket"
    assert not recognised(reduce_and_partition_stream=object()), "a stream not known"
    assert not recognised(ipg_buckets=[])

    class SuperOffloadOptimizer_Stage3(DeepSpeedZeroOptimizer_Stage3):
        pass

    engine = _Zero3Engine(SuperOffloadOptimizer_Stage3(bucket_size=4))
    assert not ds.reduces_per_partition_bucket(engine, params.values())
    unnumbered = [*params.values(), nn.Parameter(torch.zeros(1))]
    engine = _Zero3Engine(DeepSpeedZeroOptimizer_Stage3(bucket_size=4))
    assert not ds.reduces_per_partition_bucket(engine, unnumbered), "a parameter without ds_id"
    assert not ds.reduces_per_partition_bucket(_Engine(), params.values()), "unrecognised"
