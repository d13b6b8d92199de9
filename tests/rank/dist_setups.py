"""Worker functions for tests/rank/frontends/test_distributed.py (spawned processes import them).

Every worker trains the same model twice side by side, once with ampscope's scaler and
once with torch's stock scaler (same init, same data, same injected inf), and returns
plain values for the test process to compare.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 21
INJECT_STEPS = frozenset({4, 9, 10, 16})
"""0-based iterations at which rank 1 (only) gets an inf in its local gradient shard."""
GROWTH_INTERVAL = 3


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "barrier",
    "all_to_all_single",
)
"""The collectives of ``torch.distributed`` that :func:`observing_collectives` wraps."""


@contextlib.contextmanager
def observing_collectives(seen: Callable[[str, tuple[Any, ...]], None]) -> Iterator[None]:
    """Call ``seen(name, args)`` before every call of a ``torch.distributed`` collective
    in the block, made through the module's attributes (how ampscope, DDP's and FSDP1's
    Python code call them)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def observed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen(name, args)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, observed(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=generator)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def train_side_by_side(
    rank: int,
    ours_model: nn.Module,
    ours_scaler: Any,
    torch_model: nn.Module,
    torch_scaler: Any,
    inject: Callable[[nn.Module, int], None],
    *,
    input_transform: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    fused: bool = False,
) -> dict[str, Any]:
    """Train both; return skip patterns, scale trajectories and parameter equality."""

    def make_opt(model: nn.Module) -> torch.optim.Optimizer:
        if fused:
            return torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        return torch.optim.SGD(model.parameters(), lr=0.05)

    ours_opt, torch_opt = make_opt(ours_model), make_opt(torch_model)
    initial = [local_view(p.detach()).clone() for p in ours_model.parameters()]
    ours_scales, torch_scales, ours_skips, torch_skips = [], [], [], []
    for step in range(STEPS):
        x = batch(rank, step)
        if input_transform is not None:
            x = input_transform(x, step)
        for model, scaler, opt, scales, skips in (
            (ours_model, ours_scaler, ours_opt, ours_scales, ours_skips),
            (torch_model, torch_scaler, torch_opt, torch_scales, torch_skips),
        ):
            before = scaler.get_scale()
            scaler.scale(model(x).square().mean()).backward()
            if step in INJECT_STEPS:
                inject(model, step)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            # torch's scale only ever shrinks on found-inf: that is torch's skip pattern.
            skips.append(scaler.last_step_skipped if scaler is ours_scaler else scales[-1] < before)
    ours_params = [local_view(p.detach()).clone() for p in ours_model.parameters()]
    torch_params = [local_view(p.detach()).clone() for p in torch_model.parameters()]
    records = ours_scaler.telemetry.history()
    snapshot = ours_scaler.telemetry.snapshot()
    ours_scaler.close()
    return {
        "params_equal": len(ours_params) == len(torch_params)
        and all(torch.equal(a, b) for a, b in zip(ours_params, torch_params, strict=True)),
        "params_changed": any(
            not torch.equal(a, b) for a, b in zip(initial, ours_params, strict=True)
        ),
        "ours_scales": ours_scales,
        "torch_scales": torch_scales,
        "ours_skips": ours_skips,
        "torch_skips": torch_skips,
        "record_skips": [r.skipped for r in records],
        "record_scales": [r.scale_after for r in records],
        "events": [r.event for r in records],
        "local": [dict(r.found_inf_local) for r in records],
        "origin": [dict(r.found_inf_origin) for r in records],
        "nonfinite": [{p.name: p.count for p in r.nonfinite_params} for r in records],
        "identity": records[-1].identity.model_dump(),
        "totals": records[-1].totals.model_dump(),
        "snapshot_steps": snapshot.steps,
        "snapshot_skipped": snapshot.skipped_steps,
        "snapshot_local": dict(snapshot.found_inf_local),
    }


# -- FSDP1 ------------------------------------------------------------------------------


def fsdp1_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    import ampscope

    results: dict[str, Any] = {}
    # CPUOffload is not exercised: FSDP1 pins the offloaded shards, which needs an
    # accelerator. On CPU the gradients already live on the CPU, as with offloading.
    for use_orig_params in (False, True):

        def wrap(use_orig_params: bool = use_orig_params) -> nn.Module:
            return FSDP(
                make_model(), device_id=torch.device("cpu"), use_orig_params=use_orig_params
            )

        def inject(model: nn.Module, step: int, use_orig_params: bool = use_orig_params) -> None:
            if rank != 1:
                return
            if use_orig_params:
                # Rank 1's shard holds all of "2.weight"; its grad is a view of the flat grad.
                model.module[2].weight.grad.view(-1)[3] = float("inf")
            else:
                # Flat shard of rank 1 starts at element 106 of 212: local index 30 is
                # element 136, inside "0.bias" (elements 128..143).
                flat = next(model.parameters())
                flat.grad[30] = float("inf")

        ours_model = wrap()
        ours = ampscope.ShardedGradScaler(
            "cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL, reporter=None
        )
        ours.attach(ours_model)
        stock = TorchSharded("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
        results[f"use_orig_params={use_orig_params}"] = train_side_by_side(
            rank, ours_model, ours, wrap(), stock, inject
        )
    return results


# -- FSDP2 ------------------------------------------------------------------------------


def fully_shard_model(mesh: Any) -> nn.Module:
    """``make_model()`` with each Linear and the whole model ``fully_shard``-ed on ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import ampscope

    mesh = init_device_mesh("cpu", (world_size,))

    def inject(model: nn.Module, step: int) -> None:
        if rank == 1:
            model[2].weight.grad._local_tensor[0, 1] = float("inf")

    ours_model = fully_shard_model(mesh)
    ours = ampscope.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL, reporter=None
    )
    ours.attach(ours_model)
    stock = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    result = train_side_by_side(rank, ours_model, ours, fully_shard_model(mesh), stock, inject)
    result["grad_type"] = type(ours_model[2].weight).__name__
    # Fused Adam: torch's _step_supports_amp_scaling path (_check_inf_per_device).
    ours_fused = ampscope.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL, reporter=None
    )
    stock_fused = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    fused_model = fully_shard_model(mesh)
    ours_fused.attach(fused_model)
    result["fused"] = train_side_by_side(
        rank, fused_model, ours_fused, fully_shard_model(mesh), stock_fused, inject, fused=True
    )
    result["tp"] = _tensor_parallel_2d(rank, world_size)
    return result


def _tensor_parallel_2d(rank: int, world_size: int) -> dict[str, Any]:
    """A 2-D (dp=1) x (tp=2) mesh: tensor parallel plus fully_shard over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import ampscope

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))

    def build() -> nn.Module:
        model = make_model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model

    def inject(model: nn.Module, step: int) -> None:
        if rank == 1:
            local_view(model[0].weight.grad).view(-1)[5] = float("nan")

    ours_model = build()
    ours = ampscope.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL, reporter=None
    )
    ours.attach(ours_model)
    stock = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    result = train_side_by_side(rank, ours_model, ours, build(), stock, inject)
    result["placements"] = str(ours_model[0].weight.placements)
    return result


# -- DDP --------------------------------------------------------------------------------


def ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampscope

    def overflow_input(x: torch.Tensor, step: int) -> torch.Tensor:
        # A real overflow: rank 1's forward produces inf, its gradients carry it into the
        # all-reduce, and after the reduction every rank's gradients hold it.
        if rank == 1 and step in INJECT_STEPS:
            return x * 3e38
        return x

    ours_model = DDP(make_model())
    ours = ampscope.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL, reporter=None
    )
    ours.attach(ours_model, track_origin=True)
    stock = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    return train_side_by_side(
        rank,
        ours_model,
        ours,
        DDP(copy.deepcopy(make_model())),
        stock,
        lambda model, step: None,
        input_transform=overflow_input,
    )
