"""Worker for tests/rank/frontends/test_failures_distributed.py: ampscope fails inside its
capture on rank 1 only, and every rank still makes the same collectives.

Each scenario trains a front-end on real ranks side by side with the same training without
ampscope, with one capture method made to raise on rank 1 at every call. It returns the
sequence of ``torch.distributed`` collectives each rank made (name, shape, dtype, in
order), whether the parameters equal those of the training without ampscope, the
front-end's error count and what it logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from dist_setups import batch, fully_shard_model, local_view, make_model, observing_collectives
from torch import nn

import ampscope
from ampscope.rank.capture.scaler import StepCapture
from ampscope.rank.capture.watch import WatchCapture

STEPS = 4
INJECT = 2
"""0-based iteration at which rank 1's batch overflows (the watch's scenarios)."""
FAILING_RANK = 1


@contextlib.contextmanager
def recording_collectives() -> Iterator[list[tuple[str, tuple[int, ...], str]]]:
    """Every call of a ``torch.distributed`` collective in the block, with the shape and
    dtype of its first tensor, in order."""
    calls: list[tuple[str, tuple[int, ...], str]] = []

    def seen(name: str, args: tuple[Any, ...]) -> None:
        first = args[0] if args else None
        if isinstance(first, list) and first:
            first = first[0]
        if isinstance(first, torch.Tensor):
            calls.append((name, tuple(first.shape), str(first.dtype)))
        else:
            calls.append((name, (), ""))

    with observing_collectives(seen):
        yield calls


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fail_on_this_rank(rank: int, cls: type, method: str) -> None:
    """Make ``cls.method`` raise at every call, in this process only (rank 1)."""
    if rank != FAILING_RANK:
        return

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected failure in {cls.__name__}.{method}")

    setattr(cls, method, failing)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [local_view(p.detach()).clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _fsdp1() -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=True)


def _fsdp2(world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    return fully_shard_model(init_device_mesh("cpu", (world_size,)))


def _ddp() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(make_model())


def _input(rank: int, step: int) -> torch.Tensor:
    x = batch(rank, step)
    if rank == FAILING_RANK and step == INJECT:
        return x * 3e38  # rank 1's own gradients turn inf/NaN
    return x


def _scaler_run(rank: int, wrap: Callable[[], nn.Module], sharded: bool) -> dict[str, Any]:
    """A scaler whose capture cannot note the unscaled optimizer on rank 1, beside torch's."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    _fail_on_this_rank(rank, StepCapture, "unscaling")
    ours_model, stock_model = wrap(), wrap()
    # No run_id: the first update() broadcasts rank 0's, a collective of its own.
    if sharded:
        ours: Any = ampscope.ShardedGradScaler("cpu", init_scale=2.0**10, reporter=None)
        stock: Any = TorchSharded("cpu", init_scale=2.0**10)
    else:
        ours = ampscope.GradScaler("cpu", init_scale=2.0**10, reporter=None)
        stock = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ours.attach(ours_model)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.05)
    stock_opt = torch.optim.SGD(stock_model.parameters(), lr=0.05)
    with recording_collectives() as calls:
        for step in range(STEPS):
            x = batch(rank, step)
            ours.scale(ours_model(x).square().mean()).backward()
            ours.step(ours_opt)
            ours.update()
            ours_opt.zero_grad()
    for step in range(STEPS):
        x = batch(rank, step)
        stock.scale(stock_model(x).square().mean()).backward()
        stock.step(stock_opt)
        stock.update()
        stock_opt.zero_grad()
    records = ours.telemetry.history()
    out = {
        "collectives": calls,
        "params_equal": _equal(_params(ours_model), _params(stock_model)),
        "scale": ours.get_scale(),
        "stock_scale": stock.get_scale(),
        "errors": ours._ampscope_errors,
        "steps": [r.step for r in records],
        "grad_norms": [r.stats.grad_norm if r.stats else None for r in records],
        "run_ids": sorted({r.identity.run for r in records}),
    }
    ours.close()
    return out


def _watch_run(
    rank: int, wrap: Callable[[], nn.Module], policy: str, method: str
) -> dict[str, Any]:
    """A watch whose capture fails in ``method`` on rank 1, beside the same training
    without a watch that leaves out the overflowing step (the watch skips it, or stops
    before it)."""
    _fail_on_this_rank(rank, WatchCapture, method)
    watched, plain = wrap(), wrap()
    watch = ampscope.GradWatch(policy, reporter=None)  # type: ignore[arg-type]
    watch.attach(watched, track_origin=True)
    watched_opt = torch.optim.SGD(watched.parameters(), lr=0.05)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    out: dict[str, Any] = {"skipped": []}
    with recording_collectives() as calls:
        try:
            for step in range(STEPS):
                watch.scale(watched(_input(rank, step)).square().mean()).backward()
                watch.step(watched_opt)
                watch.update()
                out["skipped"].append(watch.last_step_skipped)
                watched_opt.zero_grad()
        except ampscope.NonFiniteGradientsError as error:
            out["error"] = {
                "message": str(error),
                "step": error.step,
                "origin_ranks": error.origin_ranks,
                "gathered": error.gathered,
            }
    stop = len(out["skipped"]) + (1 if "error" in out else 0)
    for step in range(stop):
        plain(batch(rank, step)).square().mean().backward()
        if step != INJECT:
            plain_opt.step()
        plain_opt.zero_grad()
    records = watch.telemetry.history()
    out.update(
        collectives=calls,
        params_equal=_equal(_params(watched), _params(plain)),
        all_finite=all(p.isfinite().all() for p in watched.parameters()),
        errors=watch._ampscope_errors,
        steps=[r.step for r in records],
    )
    watch.close()
    return out


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "sharded_scaler_fsdp1": lambda rank, world: _scaler_run(rank, _fsdp1, sharded=True),
    "scaler_fsdp2": lambda rank, world: _scaler_run(rank, lambda: _fsdp2(world), sharded=False),
    "watch_skip_fsdp1": lambda rank, world: _watch_run(rank, _fsdp1, "skip", "info"),
    "watch_raise_ddp": lambda rank, world: _watch_run(rank, _ddp, "raise", "close_iteration"),
}


def failure_worker(rank: int, world_size: int, scenario: str) -> dict[str, Any]:
    log = _Log()
    logging.getLogger("ampscope").addHandler(log)
    try:
        out = SCENARIOS[scenario](rank, world_size)
    finally:
        logging.getLogger("ampscope").removeHandler(log)
    out["logged"] = log.messages
    return out
