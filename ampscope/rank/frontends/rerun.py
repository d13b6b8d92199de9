"""Rerun a flagged iteration from the same batch and tell a transient fault from a reproducible one.

One implementation for every front-end: a scaler's ``step(optimizer, rerun=closure)`` and a
watch's. The caller hands the front-end a closure, as ``optimizer.step(closure)`` takes one:
it zeroes the gradients, runs forward and backward through the front-end's ``scale()`` on
the same batch, and returns the loss. On every iteration with a closure, once the
front-end has checked the gradients (a scaler's unscale, a watch's non-finite check),
each rank turns "my gradients or loss held inf/NaN, or my loss or the gradient norm stands
at or above my spike threshold" into a one-element flag (:func:`own_flag`; the spike test
runs on the device against :class:`~ampscope.rank.telemetry.stats_record.SpikeThresholds`
passed as scalars), all-reduces it (MAX) over the front-end's group and reads it on the
host: one collective and one sync. Clean iterations stop there and never call the
closure. When any rank flagged the iteration, every rank calls the closure once (so
DDP/FSDP collectives stay paired), the front-end checks the new gradients afresh, and each
rank compares its own first and second result (:func:`compare`): the loss, and its own
unreduced gradient norm (origin tracking's, before the gradient collective), or with origin
tracking off the norm of its local gradients after the collective (then every rank of a
DDP group sees the same norm, so only the loss tells the ranks apart).

The optimizer step then uses the rerun's gradients; the record keeps the second pass and
carries both results (:class:`RerunOutcome`). What differs between front-ends (how the
gradients are checked, and how a check is forgotten) is a :class:`Checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ampscope.rank import compat
from ampscope.reporter import schema

if TYPE_CHECKING:
    from ampscope.rank.gradients.origin import OriginFlags
    from ampscope.rank.gradients.stats import GradStats
    from ampscope.rank.telemetry.stats_record import SpikeThresholds

Closure = Callable[[], Any]
"""Recomputes this iteration's loss and gradients from the same batch (see the module)."""

NONFINITE, SPIKE = 2.0, 1.0
"""A rank's flag: inf/NaN outranks a spike, so that the agreed maximum also says why."""

SpikeTests = tuple[torch.Tensor | None, torch.Tensor | None]
"""The loss's and the gradient norm's spike test (0-dim bool tensors); ``None``: not run."""

NO_SPIKE_TESTS: SpikeTests = (None, None)


class Checks(Protocol):
    """How a front-end checks one optimizer's gradients, for :class:`Rerun`."""

    def found(self) -> Mapping[torch.device, torch.Tensor]:
        """This rank's found-inf for the optimizer (one-element flags by device), checking
        the gradients first unless the front-end (or a closure) already did."""

    def forget(self) -> None:
        """Drop the optimizer's check, so that the closure's gradients are checked afresh."""


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
    loss_spike: bool = False
    """The loss stood at or above this rank's spike threshold (read on a flagged
    iteration only)."""
    norm_spike: bool = False
    """The gradient norm (the record's ``grad_norm``) stood at or above the threshold."""

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
    """This rank's own first result was flagged: the verdict is about it (see
    :meth:`Rerun.run`)."""
    reason: schema.RerunReason = "nonfinite"
    """Why the iteration was flagged: some rank's inf/NaN, else some rank's spike."""

    @property
    def transient(self) -> bool:
        """This rank's flagged result was not reproduced: suspect its device."""
        return self.flagged and not self.reproduced

    def to_record(self) -> schema.Rerun:
        """The record's ``rerun`` (non-finite values become ``None``)."""
        return schema.Rerun(
            reason=self.reason,
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
    """Whether ``second`` reproduces ``first``, decided on non-finiteness first: two
    non-finite passes reproduce each other whatever their finite parts (dropout with a
    closure that does not restore the RNG moves the loss, not the overflow); values (loss
    and norm) are compared only when both passes are finite."""
    if first.nonfinite != second.nonfinite:
        return False
    if first.nonfinite:
        return True
    return same_value(first.loss, second.loss, rtol) and same_value(first.norm, second.norm, rtol)


def agree_flagged(own: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """The largest flag of any rank (0: nobody flagged the iteration): one all-reduce (MAX)
    of the one-element float32 flag over ``group`` (``None``: the default group) when
    several ranks run, then one host read. Every rank of the group must call it at the
    same point of every iteration that has a closure."""
    flag = own.detach().reshape(1).to(torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl" and flag.device.type == "cpu":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag.item())


def own_flag(
    found: Mapping[torch.device, torch.Tensor],
    origin: OriginFlags | None,
    spikes: SpikeTests = NO_SPIKE_TESTS,
    loss: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    fault_threshold: tuple[float, float] = (math.inf, math.inf),
) -> torch.Tensor:
    """This rank's one-element flag: :data:`NONFINITE` when its iteration is a fault by the
    fault rule (``ampscope.reporter.fault_rule``): its ``loss`` (the sum of what ``scale()``
    saw) is inf/NaN, or its pre-reduction found-inf (origin tracking: its own gradients) or
    torch's found-inf (after the collective) is set and, under a loss scaler, its ``scale``
    is at or below ``fault_threshold[0]`` (the rule's clean scale) and below
    ``fault_threshold[1]`` (its edge band): elsewhere an overflow is the scaler's weather,
    never rerun; else :data:`SPIKE` when one of ``spikes``
    (:func:`spike_tests`) is, else 0. A few small kernels, no sync: the threshold goes in as
    a scalar kernel argument."""
    flags = list(found.values())
    if origin is not None:
        flags += list(origin.peek().values())
    tests = [test for test in spikes if test is not None]
    if flags and tests:
        # An overflow's norm is inf: no spike. Spikes count on finite iterations only, as
        # the rank's spike windows see them.
        finite = torch.stack([f.reshape(()).to(tests[0].device) for f in flags]).any().logical_not()
        tests = [test.logical_and(finite) for test in tests]
    if flags and scale is not None:
        at = scale.detach().reshape(())
        fault = (at <= fault_threshold[0]).logical_and(at < fault_threshold[1])
        flags = [f.reshape(()).to(fault.device).logical_and(fault) for f in flags]
    if loss is not None:
        flags.append(~torch.isfinite(loss.detach()).all())
    if not flags and not tests:
        return torch.zeros(1)
    device = (flags or tests)[0].device
    parts = [f.reshape(()).to(device, torch.float32) * NONFINITE for f in flags]
    parts += [t.reshape(()).to(device, torch.float32) * SPIKE for t in tests]
    return torch.stack(parts).amax().reshape(1)


def spike_tests(stats: GradStats | None, thresholds: SpikeThresholds | None) -> SpikeTests:
    """This iteration's spike tests so far, on the device: the loss (the mean of what
    ``scale()`` saw) at or above ``thresholds.loss``, the gradient norm at or above
    ``thresholds.grad_norm``, each a 0-dim bool tensor; ``None`` for a threshold not known
    yet, and without stats.
    The thresholds go in as scalar kernel arguments (host floats): no copy, no sync. Within
    float32 rounding of a threshold the device may judge a value differently from the
    rank's rule on the host, which the record's ``spikes`` follow."""
    if stats is None or thresholds is None:
        return NO_SPIKE_TESTS
    loss_limit, norm_limit = thresholds.loss, thresholds.grad_norm
    loss = stats.peek_loss() if math.isfinite(loss_limit) else None
    square = stats.peek_square() if math.isfinite(norm_limit) else None
    return (
        None if loss is None else loss.float() >= loss_limit * stats.loss_count,
        # Squares: no square root kernel; both sides are non-negative.
        None if square is None else square >= norm_limit * norm_limit,
    )


class Rerun:
    """The rerun of one optimizer's flagged iteration, in the order it must happen.

    Args:
        checks: How the front-end checks the optimizer's gradients.
        optimizer: The optimizer whose step follows.
        stats: The front-end's loss and norms (``None`` with ``stats=False``: no spike test).
        origin: Its origin flags (``None`` without origin tracking).
        rtol: Relative tolerance of :func:`compare` (0: bit for bit).
        group: The ranks that rerun together (``None``: the default group).
        thresholds: The rank's spike thresholds (``None``: inf/NaN alone flags).
    """

    def __init__(
        self,
        checks: Checks,
        optimizer: torch.optim.Optimizer,
        stats: GradStats | None,
        origin: OriginFlags | None,
        rtol: float,
        *,
        group: dist.ProcessGroup | None = None,
        thresholds: SpikeThresholds | None = None,
        on_failure: Callable[[], None] | None = None,
        scale: torch.Tensor | None = None,
        fault_threshold: tuple[float, float] = (math.inf, math.inf),
        consequences: bool = False,
    ) -> None:
        self._on_failure = on_failure
        self._consequences = consequences
        self._scale = scale
        self._fault_threshold = fault_threshold
        self._checks = checks
        self._optimizer = optimizer
        self._stats = stats
        self._origin = origin
        self._rtol = rtol
        self._group = group
        self._thresholds = thresholds
        self._spikes = NO_SPIKE_TESTS
        self._agreed = 0.0

    def flagged(self) -> bool:
        """Check the gradients (if the front-end did not), then agree whether any rank
        flagged the iteration. One all-reduce and one host read."""
        found = self._checks.found()
        try:
            self._spikes = spike_tests(self._stats, self._thresholds)
            loss = None if self._stats is None else self._stats.peek_loss()
            if self._consequences:
                # The weights hold inf/NaN since an applied update: every non-finite
                # result is its consequence, no fault, and a rerun would change nothing.
                found, loss = {}, None
            own = own_flag(
                found,
                None if self._consequences else self._origin,
                self._spikes,
                loss,
                scale=self._scale,
                fault_threshold=self._fault_threshold,
            )
        except Exception:
            # This rank still takes part in the agreement (a zero flag), or the others
            # would wait for it in the all-reduce.
            if self._on_failure is not None:
                self._on_failure()
            self._spikes, own = NO_SPIKE_TESTS, torch.zeros(1)
        self._agreed = agree_flagged(own, self._group)
        return self._agreed > 0

    def run(self, closure: Closure) -> RerunOutcome:
        """Read the first pass, forget it, call ``closure``, check its gradients and
        compare. Call on every rank once :meth:`flagged` said so.

        The outcome is about this rank (``flagged``) when its own first result held
        inf/NaN, or its own loss spiked, or the gradient norm spiked and its own result
        was not reproduced: the norm is the whole model's, so under data parallelism every
        rank sees its spike, and only the rank whose result changed is named; a reproduced
        norm spike names no rank (the exporter's ``grad_norm_spike`` lists every rank's
        ids). A spike is reproduced when the second pass spikes alike (non-deterministic
        kernels move the values, not the spike), else, as inf/NaN, by :func:`compare`. A
        rank whose first pass was clean and whose rerun held inf/NaN is flagged too: the
        step goes on with that pass, and the rank's device made it."""
        first = self._read(keep=False, spikes=self._spikes)
        self._checks.forget()
        with torch.enable_grad():
            closure()
        self._checks.found()  # checks the closure's gradients unless it did (clipping)
        second = self._read(keep=True, spikes=spike_tests(self._stats, self._thresholds))
        reproduced = compare(first, second, self._rtol) or _spikes_again(first, second)
        flagged = (
            first.nonfinite
            or first.loss_spike
            or (first.norm_spike and not reproduced)
            or (second.nonfinite and not first.nonfinite)
        )
        return RerunOutcome(
            first=first,
            second=second,
            reproduced=reproduced,
            flagged=flagged,
            reason="nonfinite" if self._agreed >= NONFINITE else "spike",
        )

    def _read(self, *, keep: bool, spikes: SpikeTests = NO_SPIKE_TESTS) -> PassResult:
        """This pass's result on the host (a flagged iteration: a few reads). ``keep``
        ``False``: the stats and origin of the pass are dropped (the first pass)."""
        _optimizer, stats, origin = self._optimizer, self._stats, self._origin
        loss_tensor = None
        if stats is not None:
            loss_tensor = stats.peek_loss() if keep else stats.restart()
        found = self._checks.found()
        if origin is not None:
            flags = origin.peek() if keep else origin.take()
            squares = origin.peek_squares() if keep else origin.take_squares()
            nonfinite = any(bool(f.item()) for f in flags.values())
            norm = math.sqrt(sum(float(s.item()) for s in squares.values())) if squares else None
            if not squares:
                norm = self._local_norm()
        else:
            nonfinite = any(bool(f.item()) for f in found.values())
            norm = self._local_norm()
        loss = None if loss_tensor is None else float(loss_tensor.item())
        if loss is not None and not math.isfinite(loss):
            nonfinite = True
        loss_test, norm_test = spikes
        loss_spike = loss_test is not None and bool(loss_test.item())
        norm_spike = norm_test is not None and bool(norm_test.item())
        return PassResult(
            loss=loss, norm=norm, nonfinite=nonfinite, loss_spike=loss_spike, norm_spike=norm_spike
        )

    def _local_norm(self) -> float | None:
        """:func:`_local_norm`, or ``None`` when it fails (a sparse gradient, say): the error
        is counted in ampscope's errors (``on_failure``), never raised into training, and
        the rerun goes on (the other ranks wait for this one's collectives)."""
        try:
            return _local_norm(self._optimizer)
        except Exception:
            if self._on_failure is not None:
                self._on_failure()
            return None


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
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for norm in norms:
        by_device.setdefault(norm.device, []).append(norm)
    # One stack and one read per device (a flagged iteration only).
    on_host = [torch.stack(group).cpu() for group in by_device.values()]
    return float(torch.linalg.vector_norm(torch.cat(on_host)).item())


def _spikes_again(first: PassResult, second: PassResult) -> bool:
    """The first pass spiked (finite) and the second spiked alike, finite too."""
    spiked = first.loss_spike or first.norm_spike
    return (
        spiked
        and not first.nonfinite
        and not second.nonfinite
        and (second.loss_spike or not first.loss_spike)
        and (second.norm_spike or not first.norm_spike)
    )
