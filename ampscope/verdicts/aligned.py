"""A scaler rank's aligned step and aligned scale packed into one number, so that a store
reads them from one sample.

``scale_desync`` compares the scales of ranks at the same aligned step
(``ampscope.verdicts.scale``). Served as two gauges, the pair is only as consistent as the
store that reads it: VictoriaMetrics makes a scrape's samples searchable series by series, so
a query can pair a rank's new aligned step with the scale of its previous one, and a healthy
run whose scale backed off between them looks desynced (vmalert fired
``AmpscopeScaleDesync`` for a run without a desync). One sample holds both, whatever the
store: ``ampscope_loss_scale_aligned_packed`` is

    step + (clamp(log2(scale), -LOG2_OFFSET, LOG2_OFFSET - 1) + LOG2_OFFSET) / LOG2_SPAN

``floor()`` gives the step back (the fraction is below 1), and the fraction the scale: the
PromQL is ``PROMQL_STEP`` and ``PROMQL_SCALE``. Ranks at the same step with the same scale
pack to the same float, bit for bit. The fraction keeps 52 - log2(step) bits: below step
2**31, a scale is read back within a factor of 1.0007, so two scales that differ by a
backoff (x0.5) or a growth (x2) can never pack alike. Pure functions, no I/O.
"""

from __future__ import annotations

import math

LOG2_OFFSET = 1024
"""log2 of the scale is clamped to [-LOG2_OFFSET, LOG2_OFFSET - 1] (a float32 scale lies well
inside; a scale of 0 packs as the lowest)."""
LOG2_SPAN = 2 * LOG2_OFFSET


def pack(step: int, scale: float) -> float:
    """``step`` and ``scale`` as one float (the module's formula). O(1)."""
    if scale > 0 and math.isfinite(scale):
        log2 = min(max(math.log2(scale), -LOG2_OFFSET), LOG2_OFFSET - 1)
    else:
        log2 = LOG2_OFFSET - 1 if scale == math.inf else -LOG2_OFFSET
    return step + (log2 + LOG2_OFFSET) / LOG2_SPAN


def unpack(packed: float) -> tuple[int, float]:
    """(step, scale) of a packed value: the inverse of ``pack`` (the scale within its
    precision). O(1)."""
    step = math.floor(packed)
    return step, 2.0 ** ((packed - step) * LOG2_SPAN - LOG2_OFFSET)


def promql_step(series: str) -> str:
    """PromQL of the aligned step of a packed series (or vector expression)."""
    return f"floor({series})"


def promql_scale(series: str) -> str:
    """PromQL of the aligned scale of a packed series (or vector expression)."""
    return f"2 ^ (({series} - floor({series})) * {LOG2_SPAN} - {LOG2_OFFSET})"
