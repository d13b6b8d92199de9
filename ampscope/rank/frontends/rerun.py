"""Rerun a flagged iteration from the same batch and tell a transient fault from a reproducible one.

The caller hands the front-end a closure, as ``optimizer.step(closure)`` takes one: it
zeroes the gradients, runs forward and backward through the front-end's ``scale()`` on
the same batch, and returns the loss. On every iteration with a closure, after the
unscale, each rank turns "my gradients held inf/NaN" into a one-element flag, all-reduces
it (MAX) over the default group and reads it on the host: one collective and one sync.
Clean iterations stop there and never call the closure. When any rank flagged the
iteration, every rank calls the closure once (so DDP/FSDP collectives stay paired), the
gradients are unscaled again, found-inf is recomputed from them, and each rank compares
its own first and second result (:func:`compare`): the loss, and its own unreduced
gradient norm (origin tracking's, before the gradient collective), or with origin
tracking off the norm of its local gradients after the collective (then every rank of a
DDP group sees the same norm, so only the loss tells the ranks apart).

The optimizer step then uses the rerun's gradients; the record keeps the second pass and
carries both results (:class:`RerunOutcome`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ampscope.rank import compat
from ampscope.reporter import schema

if TYPE_CHECKING:
    from ampscope.rank.gradients.origin import OriginFlags
    from ampscope.rank.gradients.stats import GradStats

Closure = Callable[[], Any]
"""Recomputes this iteration's loss and gradients from the same batch (see the module)."""


@dataclass(frozen=True)
class PassResult:
    """One pass's own result on this rank."""

    loss: float | None
    """The loss sum ``scale()`` saw (``None``: no loss went through it)."""
    norm: float | None
    """This rank's own gradient norm, in the units compared: origin tracking's unreduced
    norm (still multiplied by the loss scale) or the local unscaled one."""
    nonfinite: bool
    """This rank's own gradients (or loss) held inf/NaN."""

    def to_record(self) -> schema.RerunPass:
        return schema.RerunPass(
            loss=_finite(self.loss), norm=_finite(self.norm), nonfinite=self.nonfinite
        )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class RerunOutcome:
    """What one rerun found on this rank."""

    first: PassResult
    second: PassResult
    reproduced: bool
    """The second result equals the first (:func:`compare`)."""
    flagged: bool
    """This rank's own first result was flagged (non-finite): the verdict is about it."""
    reason: str = "nonfinite"
    """Why the iteration was flagged on some rank."""

    def to_record(self) -> schema.Rerun:
        """The record's ``rerun`` (non-finite values become ``None``)."""
        return schema.Rerun(
            reason="nonfinite",
            flagged=self.flagged,
            reproduced=self.reproduced,
            first=self.first.to_record(),
            second=self.second.to_record(),
        )


def same_value(first: float | None, second: float | None, rtol: float) -> bool:
    """Whether two values agree: equal bit for bit with ``rtol`` 0, else within ``rtol``
    of the larger magnitude. NaN agrees with NaN, an infinity only with itself, and a
    missing value only with a missing one."""
    if first is None or second is None:
        return first is second
    if math.isnan(first) or math.isnan(second):
        return math.isnan(first) and math.isnan(second)
    if first == second:
        return True
    if math.isinf(first) or math.isinf(second):
        return False
    return abs(first - second) <= rtol * max(abs(first), abs(second))


def compare(first: PassResult, second: PassResult, rtol: float = 0.0) -> bool:
    """Whether ``second`` reproduces ``first``: same non-finiteness, loss and norm."""
    return (
        first.nonfinite == second.nonfinite
        and same_value(first.loss, second.loss, rtol)
        and same_value(first.norm, second.norm, rtol)
    )


def agree_flagged(own: torch.Tensor) -> bool:
    """Whether any rank flagged this iteration: one all-reduce (MAX) of the one-element
    float32 flag over the default group when several ranks run, then one host read.
    Every rank must call it at the same point of every iteration that has a closure."""
    flag = own.detach().reshape(1).to(torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl" and flag.device.type == "cpu":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def own_flag(
    found_inf: Mapping[torch.device, torch.Tensor], origin: OriginFlags | None
) -> torch.Tensor:
    """This rank's one-element flag: its pre-reduction found-inf when origin tracking
    runs (its own gradients), else torch's found-inf (after the collective). No sync."""
    flags = list(found_inf.values())
    if origin is not None:
        flags += list(origin.peek().values())
    if not flags:
        return torch.zeros(1)
    device = flags[0].device
    return torch.stack([f.reshape(()).to(device) for f in flags]).amax().reshape(1)


class Rerun:
    """The rerun of one flagged iteration of a scaler, in the order it must happen.

    Args:
        scaler: The front-end (an instrumented ``torch.amp.GradScaler``).
        optimizer: The optimizer whose step follows.
        stats: The front-end's loss and norms (``None`` with ``stats=False``).
        origin: Its origin flags (``None`` without origin tracking).
        rtol: Relative tolerance of :func:`compare` (0: bit for bit).
    """

    def __init__(
        self,
        scaler: Any,
        optimizer: torch.optim.Optimizer,
        stats: GradStats | None,
        origin: OriginFlags | None,
        rtol: float,
    ) -> None:
        self._scaler = scaler
        self._optimizer = optimizer
        self._stats = stats
        self._origin = origin
        self._rtol = rtol

    def flagged(self) -> bool:
        """Unscale (if the caller did not), then agree whether any rank flagged the
        iteration. One all-reduce and one host read."""
        scaler, optimizer = self._scaler, self._optimizer
        found = compat.unscaled_found_inf(scaler, optimizer)
        if found is None:
            scaler.unscale_(optimizer)
            found = compat.unscaled_found_inf(scaler, optimizer)
            assert found is not None
        return agree_flagged(own_flag(found, self._origin))

    def run(self, closure: Closure) -> RerunOutcome:
        """Read the first pass, forget it, call ``closure``, unscale its gradients and
        compare. Call on every rank once :meth:`flagged` said so."""
        first = self._take()
        compat.forget_unscale(self._scaler, self._optimizer)
        with torch.enable_grad():
            closure()
        # A closure that clips unscales itself (as the loop does before clipping).
        if compat.unscaled_found_inf(self._scaler, self._optimizer) is None:
            self._scaler.unscale_(self._optimizer)
        second = self._read(keep=True)
        return RerunOutcome(
            first=first,
            second=second,
            reproduced=compare(first, second, self._rtol),
            flagged=first.nonfinite,
        )

    def _take(self) -> PassResult:
        """The first pass's result; the stats and origin of it are dropped."""
        return self._read(keep=False)

    def _read(self, *, keep: bool) -> PassResult:
        scaler, optimizer = self._scaler, self._optimizer
        stats, origin = self._stats, self._origin
        loss_tensor = None
        if stats is not None:
            loss_tensor = stats.peek_loss() if keep else stats.restart()
        found = compat.unscaled_found_inf(scaler, optimizer) or {}
        if origin is not None:
            flags = origin.peek() if keep else origin.take()
            squares = origin.peek_squares() if keep else origin.take_squares()
            nonfinite = any(bool(f.item()) for f in flags.values())
            norm = math.sqrt(sum(float(s.item()) for s in squares.values())) if squares else None
            if not squares:
                norm = _local_norm(optimizer)
        else:
            nonfinite = any(bool(f.item()) for f in found.values())
            norm = _local_norm(optimizer)
        loss = None if loss_tensor is None else float(loss_tensor.item())
        if loss is not None and not math.isfinite(loss):
            nonfinite = True
        return PassResult(loss=loss, norm=norm, nonfinite=nonfinite)


def _local_norm(optimizer: torch.optim.Optimizer) -> float | None:
    """The norm of this rank's local gradients (as they are now), on the host."""
    grads = [
        compat.local_tensor(p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not grads:
        return None
    norms = compat.foreach_norm([g.float() for g in grads], False)
    return float(torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms])).item())
