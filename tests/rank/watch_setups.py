"""Worker for tests/rank/frontends/test_watch_distributed.py: every policy of a GradWatch on every
data-parallel setup, in one launch of real ranks.

For each setup (DDP, FSDP1, FSDP2 on a 1-D mesh, FSDP2 with tensor parallelism on a 2-D
mesh) the worker trains the same model several times side by side: without a watch, and
with the watch under each policy; rank 1's gradients turn non-finite at iteration
``INJECT``. It returns plain values for the test process to compare.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from dist_setups import local_view, make_model, observing_collectives
from torch import nn

import ampscope

STEPS = 5
INJECT = 2
"""0-based iteration at which rank 1's gradients (only) hold inf/NaN."""
BAD_RANK = 1
_RANK = Path(ampscope.__file__).parent / "rank"
WATCH_FILES = frozenset(
    str(_RANK / name)
    for name in (
        "frontends/watch.py",
        "capture/watch.py",
        "frontends/stop.py",
        "frontends/base.py",
    )
)
"""The watch's own code: a collective called with one of these on the stack is the
watch's (DDP's and FSDP's collectives, and origin hooks' inside backward, are not)."""


def _called_by_watch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in WATCH_FILES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count the calls of ``torch.distributed`` collectives that the watch makes in the
    block (through the module's attributes, which is how ampscope calls them)."""
    counts: dict[str, int] = {}

    def seen(name: str, args: tuple[Any, ...]) -> None:
        if _called_by_watch():
            counts[name] = counts.get(name, 0) + 1

    with observing_collectives(seen):
        yield counts


def batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=generator)


class Setup:
    """How one data-parallel setup builds its model and where rank 1's inf comes from."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        origin: bool,
        data: bool,
        rank: int,
    ) -> None:
        self.build = build
        self.origin = origin
        self.data = data
        """Inject through rank 1's batch (else through its local gradient shard)."""
        self.rank = rank

    def input(self, step: int) -> torch.Tensor:
        x = batch(0 if not self.data else self.rank, step)
        if self.data and self.rank == BAD_RANK and step == INJECT:
            return x * 3e38  # overflows in rank 1's forward: its own gradients are inf/NaN
        return x

    def after_backward(self, model: nn.Module, step: int) -> None:
        if not self.data and self.rank == BAD_RANK and step == INJECT:
            local_view(model[0].weight.grad).view(-1)[5] = float("nan")


def train(
    setup: Setup, watch: Any, *, skip_at: int | None = None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """One run; ``watch=None`` trains without one and leaves out the step ``skip_at``."""
    model = setup.build()
    if watch is not None:
        watch.attach(model, track_origin=setup.origin)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"skipped": []}
    try:
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(setup.input(step)).float().square().mean()
            (loss if watch is None else watch.scale(loss)).backward()
            setup.after_backward(model, step)
            if watch is None:
                if step != skip_at:
                    opt.step()
            else:
                watch.step(opt)
                watch.update()
                out["skipped"].append(watch.last_step_skipped)
            opt.zero_grad()
    except ampscope.NonFiniteGradientsError as error:
        out["error"] = {
            "message": str(error),
            "step": error.step,
            "origin_ranks": error.origin_ranks,
            "local_ranks": error.local_ranks,
            "params": error.params,
        }
    if watch is not None:
        records = watch.telemetry.history()
        watch.close()
        out["records"] = [r.model_dump(mode="json", exclude={"time"}) for r in records]
    return [local_view(p.detach()).clone() for p in model.parameters()], out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit equality, NaN equal to NaN whatever its bit pattern."""

    def equal(x: torch.Tensor, y: torch.Tensor) -> bool:
        nan = x.isnan()
        width = {2: torch.int16, 4: torch.int32}[x.element_size()]
        return torch.equal(nan, y.isnan()) and torch.equal(x[~nan].view(width), y[~nan].view(width))

    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))


def run_policies(setup: Setup) -> dict[str, Any]:
    def watch(policy: str) -> ampscope.GradWatch:
        # run_id given: the first update() broadcasts no generated one.
        return ampscope.GradWatch(policy, run_id="watch-test", reporter=None)  # type: ignore[arg-type]

    result: dict[str, Any] = {}
    plain, _ = train(setup, None)
    with counting_collectives() as counts:
        observed, result["observe"] = train(setup, watch("observe"))
    result["observe"]["bit_identical"] = same_bits(plain, observed)
    result["observe"]["nonfinite_params"] = any(not p.isfinite().all() for p in observed)
    result["observe"]["collectives"] = counts

    reference, _ = train(setup, None, skip_at=INJECT)
    with counting_collectives() as counts:
        skipped, result["skip"] = train(setup, watch("skip"))
    result["skip"]["equal_reference"] = same_bits(reference, skipped)
    result["skip"]["all_finite"] = all(p.isfinite().all() for p in skipped)
    result["skip"]["collectives"] = counts

    with counting_collectives() as counts:
        stopped, result["raise"] = train(setup, watch("raise"))
    result["raise"]["all_finite"] = all(p.isfinite().all() for p in stopped)
    result["raise"]["collectives"] = counts
    return result


def _ddp(rank: int, dtype: torch.dtype = torch.float32) -> Setup:
    """DDP; in bfloat16 the parameters, gradients and all-reduced buckets are bf16."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return Setup(lambda: DDP(make_model().to(dtype)), origin=True, data=True, rank=rank)


def _fsdp1(rank: int) -> Setup:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return Setup(
        lambda: FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=True),
        origin=True,
        data=True,
        rank=rank,
    )


def _fsdp2(rank: int, world_size: int, *, bf16: bool = False) -> Setup:
    """FSDP2 on a 1-D mesh; ``bf16``: bf16 compute and bf16 reduce-scatter
    (``MixedPrecisionPolicy``), the sharded gradients float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if bf16
        else MixedPrecisionPolicy()
    )

    def build() -> nn.Module:
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    return Setup(build, origin=True, data=True, rank=rank)


def _tensor_parallel(rank: int, world_size: int) -> Setup:
    """A (dp=1) x (tp=2) mesh. Both ranks of a tensor-parallel group read the same batch,
    so rank 1's NaN goes into its own gradient shard; with one data-parallel replica no
    gradient collective runs that origin tracking could check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))

    def build() -> nn.Module:
        model = make_model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model

    return Setup(build, origin=False, data=False, rank=rank)


def watch_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "ddp": run_policies(_ddp(rank)),
        "ddp_bf16": run_policies(_ddp(rank, torch.bfloat16)),
        "fsdp1": run_policies(_fsdp1(rank)),
        "fsdp2": run_policies(_fsdp2(rank, world_size)),
        "fsdp2_bf16_reduce": run_policies(_fsdp2(rank, world_size, bf16=True)),
        "tp": run_policies(_tensor_parallel(rank, world_size)),
    }
