"""ampscope's repeat of torchtitan's and OLMo-core's clips beside the libraries' own, on
the same gradients, for spawned ranks; plain values back (whether bits agree)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

MAX_NORM = 0.5
"""Low enough that every case clips."""
LOOP_STEPS = 4
CLOSE_AFTER = 1
"""Rank 0's watch closes after this many iterations of :func:`_titan_loop`."""


def _bits(tensor: torch.Tensor) -> list[int]:
    from ampscope.rank import compat

    return compat.local_tensor(tensor).detach().float().view(torch.int32).flatten().tolist()


def _titan_loop(rank: int, policy: str, subset: bool) -> dict[str, Any]:
    """FSDP2 training through torchtitan's wrapped clip and ``WatchedLRSchedulers``, rank
    0's watch closed after ``CLOSE_AFTER`` iterations; after each iteration an all-reduce
    of a sentinel shows whether every rank made the same collectives. ``subset``: the
    optimizer steps the first layer only (the clip's parameters are not the optimizer's)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import utils as dist_utils

    import ampscope
    from ampscope.integrations.torchtitan import WatchedLRSchedulers

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model)
    optimizer = torch.optim.SGD((model[0] if subset else model).parameters(), lr=0.1)
    optimizers = type("Optimizers", (list,), {})([optimizer])
    optimizers.model_parts = [model]
    schedulers = SimpleNamespace(
        schedulers=[torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)]
    )
    watch = ampscope.GradWatch(policy, reporter=None)
    container = WatchedLRSchedulers(schedulers, optimizers, watch, False)  # type: ignore[arg-type]
    data = torch.Generator().manual_seed(rank)
    sentinels, totals = [], []
    for step in range(LOOP_STEPS):
        model(torch.randn(3, 4, generator=data)).square().mean().backward()
        totals.append(float(dist_utils.clip_grad_norm_(list(model.parameters()), 0.01)))
        optimizer.step()
        container.step()
        optimizer.zero_grad()
        sentinel = torch.tensor([float(step)])
        torch.distributed.all_reduce(sentinel)
        sentinels.append(float(sentinel))
        if rank == 0 and step == CLOSE_AFTER - 1:
            watch.close()
    records = watch.telemetry.history()
    container.close()
    return {
        "sentinels": sentinels,
        "totals": totals,
        "grad_norms": [r.stats.grad_norm for r in records],
    }


def clip_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Each library's clip and ampscope's repeat of it: FSDP2's layout (DTensors sharded on
    dim 0 of a mesh of every rank; OLMo-core's ``foreach=None`` takes torch's multi-tensor
    path for them too), with a pipeline mesh (torchtitan; the same ranks stand in for the
    stages: the sum is what is compared), plain tensors, a NaN gradient; then the calls
    ampscope leaves to the library."""
    from olmo_core.train.train_module.transformer.train_module import TransformerTrainModule
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torchtitan.distributed import utils as dist_utils

    from ampscope.integrations import _clip_repeat, olmo_core, torchtitan
    from ampscope.rank import compat

    titan = getattr(dist_utils.clip_grad_norm_, "__wrapped__", dist_utils.clip_grad_norm_)
    signature = inspect.signature(titan)
    olmo = TransformerTrainModule._clip_grad_norm
    mesh = init_device_mesh("cpu", (world_size,))

    def params(
        dtensor: bool, nan: bool = False, dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(11)  # the same full tensors on every rank
        out = []
        for i, rows in enumerate((6, 4, 10)):
            value = torch.randn(rows, 3, generator=generator, dtype=dtype)
            grad = torch.randn(rows, 3, generator=generator, dtype=dtype) * (i + 1)
            if nan and i == 1:
                grad[0, 0] = float("nan")
            if dtensor:
                value = distribute_tensor(value, mesh, [Shard(0)])
                grad = distribute_tensor(grad, mesh, [Shard(0)])
            param = torch.nn.Parameter(value)
            param.grad = grad
            out.append(param)
        return out

    def compare(library: str, dtensor: bool, nan: bool = False, **kwargs: Any) -> dict[str, Any]:
        stock, ours = params(dtensor, nan), params(dtensor, nan)
        # What the watch's own pass computed from these gradients before.
        expected_local = torch._foreach_norm([compat.local_tensor(p.grad) for p in ours], 2)
        foreach = kwargs.get("foreach")  # OLMo-core's: None
        expected_stage = torch.nn.utils.get_total_norm([p.grad for p in ours], 2.0, False, foreach)
        if compat.is_dtensor(expected_stage):
            expected_stage = expected_stage.full_tensor()
        if library == "torchtitan":
            theirs = titan(stock, MAX_NORM, **kwargs)
            call = torchtitan._keeping_call({}, signature, (ours, MAX_NORM), kwargs)
        else:
            theirs = olmo(
                SimpleNamespace(model=SimpleNamespace(parameters=lambda: stock)), MAX_NORM
            )
            call = olmo_core._keeping_call({}, SimpleNamespace(parameters=lambda: ours), MAX_NORM)
        assert call is not None
        total, local, stage = _clip_repeat.clip(call)
        return {
            "total": _bits(total) == _bits(theirs),
            "grads": [_bits(p.grad) for p in ours] == [_bits(p.grad) for p in stock],
            "local": _bits(local) == _bits(torch.stack(expected_local)),
            "stage": _bits(stage) == _bits(expected_stage),
            "nan": bool(total.isnan()),
        }

    sharded, plain = params(True), params(False)
    mixed = params(True)
    mixed[1].grad = distribute_tensor(mixed[1].grad.full_tensor(), mesh, [Replicate()])
    missing = params(True)
    missing[2].grad = None
    left: dict[str, Any] = {
        "ep": (sharded, 1.0, 2.0, False, True, None, True),
        "inf": (sharded, 1.0, float("inf")),
        "foreach_false": (sharded, 1.0, 2.0, False, False),
        "missing_grad": (missing, 1.0, 2.0, False, True),
        "bf16": (params(True, dtype=torch.bfloat16), 1.0, 2.0, False, True),
        "mixed_layouts": (mixed, 1.0, 2.0, False, True),
        "generator": (iter(plain), 1.0),
        "bad_arguments": (plain,),
    }
    return {
        "recognised": [
            _clip_repeat.recognised(titan, torchtitan.KNOWN_CLIP, "torchtitan's"),
            _clip_repeat.recognised(olmo, olmo_core.KNOWN_CLIP, "OLMo-core's"),
        ],
        "torchtitan": compare("torchtitan", True, foreach=True),
        "torchtitan_pp": compare("torchtitan", True, foreach=True, pp_mesh=mesh),
        "torchtitan_plain": compare("torchtitan", False),
        "torchtitan_nan": compare("torchtitan", True, nan=True, foreach=True),
        "olmo_core": compare("olmo_core", True),
        "olmo_core_plain": compare("olmo_core", False),
        "olmo_core_nan": compare("olmo_core", True, nan=True),
        "left": sorted(
            name
            for name, args in left.items()
            if torchtitan._keeping_call({}, signature, args, {}) is None
        ),
        "left_names": sorted(left),
        "loops": {
            f"{policy}{'-subset' if subset else ''}": _titan_loop(rank, policy, subset)
            for policy in ("observe", "skip")
            for subset in (False, True)
        },
    }
