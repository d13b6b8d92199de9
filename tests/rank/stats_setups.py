"""Worker of tests/rank/gradients/test_stats_distributed.py (spawned processes import it).

Each setup trains a few iterations on real ranks; at ``SPIKE`` rank ``BAD_RANK`` multiplies
its inputs by ``FACTOR``, so its own loss and gradients spike. Every iteration the worker
also computes what torch says: ``clip_grad_norm_`` after ``unscale_`` (an infinite max
clips nothing), and this rank's own gradient norm, from an unwrapped copy of the model
with the same weights on the same batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from dist_setups import batch, local_view, make_model
from torch import nn

from ampscope.reporter.spike_rule import SpikeRule

STEPS = 8
SPIKE = 6
BAD_RANK = 1
FACTOR = 30.0
RULE = SpikeRule(window=10, min_window=4)
"""Can fire from the fifth iteration on, so the runs stay short."""
SCALE = 2.0**10
FAIL_AT = 2
"""``fsdp1_failing``: the iteration at which one rank's local norms raise."""


def _own_norm(plain: nn.Module, x: torch.Tensor) -> float:
    """This rank's own gradient norm: the unwrapped model's, on this rank's batch alone."""
    plain.zero_grad()
    plain(x).square().mean().backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()])).item()


def _train(
    rank: int,
    model: nn.Module,
    scaler: Any,
    clip: Callable[[], torch.Tensor],
    full_params: Callable[[], list[torch.Tensor]] | None,
) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain = make_model()
    clipped, own = [], []
    for step in range(STEPS):
        x = batch(rank, step)
        if rank == BAD_RANK and step == SPIKE:
            x = x * FACTOR
        if full_params is not None:
            with torch.no_grad():
                for mine, full in zip(plain.parameters(), full_params(), strict=True):
                    mine.copy_(full)
            own.append(_own_norm(plain, x))
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opt)
        clipped.append(float(local_view(clip()).item()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    records = scaler.telemetry.history()
    errors = scaler._ampscope_errors
    scaler.close()
    return {
        "errors": errors,
        "clip": clipped,
        "own": own,
        "skipped": [r.skipped for r in records],
        "stats": [r.stats.model_dump() for r in records],
        "names": sorted(n for n, _ in make_model().named_parameters()),
    }


def _ddp(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampscope

    model = DDP(make_model())
    scaler = ampscope.GradScaler("cpu", init_scale=SCALE, reporter=None, spike_rule=RULE)
    scaler.attach(model, track_origin=True)
    return _train(
        rank,
        model,
        scaler,
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf),
        lambda: [p.detach() for p in model.module.parameters()],
    )


def _fully_shard(world_size: int, reduce_dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _fsdp2(
    rank: int, world_size: int, front_end: str, reduce_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    import ampscope

    model = _fully_shard(world_size, reduce_dtype)
    scaler: Any = (
        ampscope.GradScaler(
            "cpu",
            # The spike's float16 gradients must stay finite: a scale of 1.
            init_scale=SCALE if reduce_dtype is None else 1.0,
            reporter=None,
            spike_rule=RULE,
        )
        if front_end == "scaler"
        else ampscope.GradWatch(reporter=None, spike_rule=RULE, run_id="stats-watch")
    )
    scaler.attach(model, track_origin=True)
    return _train(
        rank,
        model,
        scaler,
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf),
        lambda: [p.full_tensor() for p in model.parameters()],  # type: ignore[attr-defined]
    )


def _fsdp1(rank: int, fail_at: int | None = None) -> dict[str, Any]:
    """FSDP1; ``fail_at``: rank ``BAD_RANK``'s local norms raise at that iteration."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import ampscope
    from ampscope.rank import compat

    if fail_at is not None and rank == BAD_RANK:
        original, calls = compat.foreach_norm, [0]

        def failing(tensors: list[torch.Tensor], low_precision: bool) -> Any:
            calls[0] += 1
            if calls[0] == fail_at + 1:
                raise RuntimeError("injected: the local norms fail on one rank")
            return original(tensors, low_precision)

        compat.foreach_norm = failing  # type: ignore[assignment]

    model = FSDP(make_model(), device_id=torch.device("cpu"))
    scaler = ampscope.ShardedGradScaler("cpu", init_scale=SCALE, reporter=None, spike_rule=RULE)
    scaler.attach(model, track_origin=True)

    def full_params() -> list[torch.Tensor]:
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.module.parameters()]

    try:
        return _train(rank, model, scaler, lambda: model.clip_grad_norm_(math.inf), full_params)
    finally:
        if fail_at is not None and rank == BAD_RANK:
            compat.foreach_norm = original


def stats_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "ddp": _ddp(rank),
        "fsdp2": _fsdp2(rank, world_size, "scaler"),
        "fsdp2_watch": _fsdp2(rank, world_size, "watch"),
        # A float16 reduce-scatter: FSDP2 pre-divides its input (by 2 on 2 ranks).
        "fsdp2_fp16_reduce": _fsdp2(rank, world_size, "scaler", torch.float16),
        "fsdp1": _fsdp1(rank),
        "fsdp1_failing": _fsdp1(rank, fail_at=FAIL_AT),
    }
