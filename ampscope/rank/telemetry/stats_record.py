"""A pending step's loss and gradient norms → the record's :class:`StepStats`; the rank's
own spike rule.

Runs on the telemetry thread, in step order, inside
:class:`~ampscope.rank.telemetry.records.RecordBuilder`. Per record it reads a few host values and
feeds two :class:`~ampscope.reporter.spike_rule.SpikeWindow` (loss, grad norm); only on a spike
iteration does it read the per-parameter norms (host memory: the CPU tensors themselves,
or the tail of the step's pinned host copy) to name the top-K parameters. Once a front-end
reruns flagged iterations (``rerun=closure``) it also publishes the windows' current
thresholds (:class:`SpikeThresholds`), for the training thread to compare on the device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ampscope.rank.gradients.stats import OptimizerNorms, TakenStats
from ampscope.reporter.schema import ParamNorm, SpikeKind
from ampscope.reporter.spike_rule import SpikeRule, SpikeWindow

_OVERFLOW: dict[str, Any] = {
    "loss": None,
    "grad_norm": None,
    "grad_norm_origin": None,
    "spikes": [],
    "top_params": [],
}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class SpikeThresholds:
    """The rank's current spike thresholds, written by the telemetry thread, read by the
    training thread (plain floats: each write and read is atomic under the GIL; a pair
    read between the two writes is one old, one new, which is harmless).

    The training thread passes them to comparison kernels as scalar arguments: on the
    device, with no copy and no sync. They lag the training thread by the records not yet
    built (usually a step or two).
    """

    __slots__ = ("armed", "grad_norm", "loss")

    def __init__(self) -> None:
        self.armed = False
        """A front-end reruns spike iterations: the telemetry thread keeps the thresholds
        (one median per series and record); until then it spends nothing on them."""
        self.loss = math.inf
        """The least loss (this rank's mean over the iteration's micro-batches) that is a
        spike; ``inf``: none yet (too few values known)."""
        self.grad_norm = math.inf
        """The least gradient norm (the record's ``grad_norm``) that is a spike."""


class StatsBuilder:
    """The rank's spike windows and the builder of each record's stats.

    Args:
        k: How many parameters a spike iteration names at most.
        rule: The rank's spike rule (default: OLMo-core's, as the exporter's).
    """

    def __init__(self, k: int, rule: SpikeRule | None = None) -> None:
        self._k = k
        self.loss_window = SpikeWindow(rule)
        self.grad_norm_window = SpikeWindow(rule)
        self.thresholds = SpikeThresholds()
        self._scratch = _Float64Scratch()
        self._none: list[Any] = []
        """The empty ``spikes`` and ``top_params`` of every record without a spike, one
        list shared (records never change theirs)."""

    @staticmethod
    def host_scalars(
        taken: TakenStats, values: Sequence[float], stats_at: int, *, on_host: bool
    ) -> Sequence[float]:
        """The stats' scalars (:meth:`TakenStats.scalars`, the loss sum first) on the host,
        read once per record for :meth:`build` and the fault rule: on the device transport
        they follow the step's values from ``values[stats_at]``; on the host transport
        (``on_host``) they are CPU tensors, read here (host memory, no sync)."""
        if on_host:
            return list(map(torch.Tensor.item, taken.scalars()))
        return values[stats_at:]

    def build(
        self,
        taken: TakenStats,
        scalars: Sequence[float],
        *,
        overflow: bool,
        scale: float,
        host_norms: torch.Tensor | None,
    ) -> tuple[dict[str, Any], bool]:
        """The fields of one step's :class:`StepStats`; and whether they need validation (a
        spike names parameters: names the schema has not seen). Every number is finite or
        ``None``.

        Args:
            taken: The step's stats as the training thread took them.
            scalars: Their host values (:meth:`host_scalars`).
            overflow: The iteration's gradients held inf/NaN: every value is ``None`` and
                the windows see nothing.
            scale: The loss scale the gradients were scaled by in backward (1 for a watch).
            host_norms: Device transport: the host copy of every optimizer's
                per-parameter norms, concatenated (``None`` when there are none).
        """
        if overflow:
            return {**_OVERFLOW, "spikes": [], "top_params": []}, False
        # A scale that underflowed to 0 leaves scaled norms unknown (None), not infinite.
        inverse = 1.0 / scale if scale > 0 else math.nan
        loss_sum, squares, origin_squares = taken.named(scalars)
        loss = None
        if loss_sum is not None:
            loss = loss_sum / taken.loss_count
            if not math.isfinite(loss):
                loss = None
        grad_square = 0.0
        start = 0
        for optimizer, summed in zip(taken.optimizers, squares, strict=True):
            square = (
                _square_sum(optimizer, host_norms, start, self._scratch)
                if summed is None
                else summed
            )
            start += optimizer.count
            factor = inverse if optimizer.scaled else 1.0
            grad_square += square * factor * factor
        grad_norm = None
        if taken.optimizers:
            grad_norm = math.sqrt(grad_square)
            if not math.isfinite(grad_norm):  # _finite's test, without a call per record
                grad_norm = None
        origin = None
        if taken.origin:
            own = sum(origin_squares)
            origin = _finite(math.sqrt(own) * inverse) if own >= 0 else None
        spikes: list[SpikeKind] = self._none
        if self.loss_window.observe(loss) is not None:
            spikes = ["loss"]
        if self.grad_norm_window.observe(grad_norm) is not None:
            spikes = [*spikes, "grad_norm"]
        thresholds = self.thresholds
        if thresholds.armed:
            thresholds.loss = self.loss_window.threshold()
            thresholds.grad_norm = self.grad_norm_window.threshold()
        top: list[ParamNorm] = self._none
        if spikes:
            top = self._top_params(taken, inverse, host_norms)
        fields = {
            "loss": loss,
            "grad_norm": grad_norm,
            "grad_norm_origin": origin,
            "spikes": spikes,
            "top_params": top,
        }
        return fields, bool(top)

    def _top_params(
        self, taken: TakenStats, inverse: float, host_norms: torch.Tensor | None
    ) -> list[ParamNorm]:
        """The K largest per-parameter norms, largest first, ties by name; a name met in
        several optimizers gets the L2 norm of its parts."""
        squares: dict[str, float] = {}
        start = 0
        for optimizer in taken.optimizers:
            norms = _norms(optimizer, host_norms, start).tolist()
            start += optimizer.count
            factor = inverse if optimizer.scaled else 1.0
            for name, norm in zip(optimizer.names, norms, strict=True):
                value = norm * factor
                squares[name] = squares.get(name, 0.0) + value * value
        ranked = sorted(
            ((name, math.sqrt(square)) for name, square in squares.items()),
            key=lambda item: (-item[1], item[0]),
        )
        return [
            ParamNorm.model_construct(name=name, norm=norm)
            for name, norm in ranked[: self._k]
            if math.isfinite(norm)
        ]


SMALL = 64
"""Up to this many norms, Python sums their squares faster than two more tensor ops."""


class _Float64Scratch:
    """One float64 vector per norm count, reused for every record's squared sum: a copy
    into it is one op where a cast is two (``float()``, ``double()``) and an allocation.
    Telemetry thread only (the builder runs under the pipeline's resolve lock)."""

    __slots__ = ("_vectors",)

    def __init__(self) -> None:
        self._vectors: dict[int, torch.Tensor] = {}

    def widened(self, norms: torch.Tensor, count: int) -> torch.Tensor:
        """``norms`` (a CPU vector of ``count`` values) in float64, as ``norms.double()``
        gives it (exact from every floating dtype)."""
        vector = self._vectors.get(count)
        if vector is None:
            if len(self._vectors) >= 16:  # bounded: counts change only with the plans
                self._vectors.clear()
            vector = self._vectors[count] = torch.empty(count, dtype=torch.float64)
        return vector.copy_(norms)


def _square_sum(
    optimizer: OptimizerNorms,
    host_norms: torch.Tensor | None,
    start: int,
    scratch: _Float64Scratch,
) -> float:
    """The sum of one optimizer's squared per-parameter norms."""
    count = optimizer.count
    if not count:
        return 0.0
    if count > SMALL:
        # float64 as fsum below (no float32 rounding in the sum); the same dot product
        # of the same float64 values as ever, bit for bit.
        if host_norms is not None:
            # shape[0], not len(): a tensor's __len__ is Python, several times dearer.
            whole = start == 0 and count == host_norms.shape[0]
            norms = host_norms if whole else host_norms[start : start + count]
        elif optimizer.packed is not None:
            norms = optimizer.packed.float()  # read in float32, as ever (a no-op for float32)
        else:
            norms = torch.stack(optimizer.norms)  # float64 norms stay float64
        wide = scratch.widened(norms, count)
        return torch.dot(wide, wide).item()
    if host_norms is not None:
        values = host_norms[start : start + count].tolist()
    elif optimizer.packed is not None:
        values = optimizer.packed.tolist()
    else:
        values = torch.stack(optimizer.norms).tolist()  # one read, not one per norm
    # The same products and the same exact sum as ``fsum(v * v for v in values)``, with no
    # Python bytecode per norm.
    return math.fsum(map(operator.mul, values, values))


def _norms(optimizer: OptimizerNorms, host_norms: torch.Tensor | None, start: int) -> torch.Tensor:
    """One optimizer's per-parameter norms as a CPU vector: its slice of the host copy, or
    its own CPU tensors stacked."""
    if host_norms is not None:
        return host_norms[start : start + optimizer.count]
    if optimizer.packed is not None:
        return optimizer.packed.float()
    if not optimizer.norms:
        return torch.zeros(0)
    return torch.stack(optimizer.norms)
