"""A pending step's loss and gradient norms → the record's :class:`StepStats`; the rank's
own spike rule.

Runs on the telemetry thread, in step order, inside
:class:`~ampscope.scaler.records.RecordBuilder`. Per record it reads a few host values and
feeds two :class:`~ampscope.reporter.spikes.SpikeWindow` (loss, grad norm); only on a spike
iteration does it read the per-parameter norms (host memory: the CPU tensors themselves,
or the tail of the step's pinned host copy) to name the top-K parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ampscope.reporter.schema import ParamNorm, SpikeKind
from ampscope.reporter.spikes import SpikeRule, SpikeWindow
from ampscope.scaler.grad_stats import TakenStats

_OVERFLOW: dict[str, Any] = {
    "loss": None,
    "grad_norm": None,
    "grad_norm_origin": None,
    "spikes": [],
    "top_params": [],
}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


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

    def build(
        self,
        taken: TakenStats,
        values: Sequence[float],
        offset: int,
        *,
        overflow: bool,
        scale: float,
        host_norms: torch.Tensor | None,
    ) -> tuple[dict[str, Any], bool]:
        """The fields of one step's :class:`StepStats`, whose values start at
        ``values[offset]``; and whether they need validation (a spike names parameters:
        names the schema has not seen). Every number is finite or ``None``.

        Args:
            taken: The step's stats as the training thread took them.
            values: The step's host values (:meth:`TakenStats.scalars` order from
                ``offset``).
            overflow: The iteration's gradients held inf/NaN: every value is ``None`` and
                the windows see nothing.
            scale: The loss scale the gradients were scaled by in backward (1 for a watch).
            host_norms: Device transport: the per-parameter norms' host copy, all
                optimizers concatenated; ``None``: the norms tensors are on the CPU.
        """
        if overflow:
            return dict(_OVERFLOW), False
        # A scale that underflowed to 0 leaves scaled norms unknown (None), not infinite.
        inverse = 1.0 / scale if scale > 0 else math.nan
        loss = None
        if taken.loss is not None:
            loss = _finite(values[offset] / taken.loss_count)
            offset += 1
        grad_square = 0.0
        for optimizer in taken.optimizers:
            factor = inverse if optimizer.scaled else 1.0
            grad_square += values[offset] * factor * factor
            offset += 1
        grad_norm = _finite(math.sqrt(grad_square)) if taken.optimizers else None
        origin = None
        if taken.origin:
            own = sum(values[offset : offset + len(taken.origin)])
            origin = _finite(math.sqrt(own) * inverse) if own >= 0 else None
        spikes: list[SpikeKind] = []
        if self.loss_window.observe(loss) is not None:
            spikes.append("loss")
        if self.grad_norm_window.observe(grad_norm) is not None:
            spikes.append("grad_norm")
        top: list[ParamNorm] = []
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
            count = len(optimizer.names)
            if host_norms is None:
                norms = optimizer.norms.tolist()
            else:
                norms = host_norms[start : start + count].tolist()
            start += count
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
