"""An observed iteration's FP8 values, on the host, as the records' ``fp8`` entries.

Runs on the telemetry thread, in plain Python: the device shipped four values per tensor
(:class:`~ampscope.rank.fp8.casts.CastStats`), from which this derives the scales
(torchao's ``amax_to_scale``, reproduced by :mod:`ampscope.rank.fp8.scales`) and the
ratio (the underflowed count, exact on the device, over the non-zero count).

Under a loss scaler the ``grad_output`` the layer cast was the scaled gradient: its amax
is divided by the iteration's loss scale and its scale multiplied by it, so that every
value describes the unscaled gradient (the underflow ratio does not change with the loss
scale: the cast's own scale follows it).
"""

from __future__ import annotations

import math

from ampscope.rank.fp8.casts import VALUES, Source
from ampscope.rank.fp8.observer import Fp8Slot, Fp8Taken
from ampscope.rank.fp8.scales import amax_to_scale
from ampscope.reporter.schema import Fp8Tensor


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _amax_of_scale(fp8_max: float, scale: float) -> float:
    """The amax a cast derived ``scale`` from (FSDP2's reduced amax)."""
    if math.isnan(scale):
        return math.nan
    return fp8_max / scale if scale > 0.0 else math.inf


def _decode(
    slot: Fp8Slot, source: Source, numel: int, values: list[float]
) -> tuple[float, float, float, float, float]:
    """amax, underflowed, the ratio's denominator, the largest and smallest scale."""
    high, underflowed, nonzero, low = values
    if source == "amax":
        amax = high
        # A larger amax gives a smaller scale (torchao's is monotone): the largest scale
        # is the smallest amax's.
        scale_max = amax_to_scale(low, slot.fp8_max, slot.power_of_2)
        scale_min = amax_to_scale(high, slot.fp8_max, slot.power_of_2)
    else:
        scale_max, scale_min = high, low
        amax = _amax_of_scale(slot.fp8_max, scale_min)
    if source == "fp8_zeros":
        return amax, underflowed, float(numel), scale_max, scale_min
    return amax, underflowed, nonzero, scale_max, scale_min


def fp8_entries(taken: Fp8Taken, values: list[float], loss_scale: float) -> list[Fp8Tensor]:
    """The entries of one observed iteration.

    Args:
        taken: What names the values (``PendingStep.fp8``).
        values: Their host values, ``VALUES`` per slot.
        loss_scale: The loss scale ``grad_output`` carries (1 without a scaler).
    """
    unscale = loss_scale if math.isfinite(loss_scale) and loss_scale > 0 else 1.0
    out = []
    for index, (slot, calls, numel, source) in enumerate(
        zip(taken.slots, taken.calls, taken.numel, taken.sources, strict=True)
    ):
        amax, underflowed, nonzero, scale_max, scale_min = _decode(
            slot, source, numel, values[VALUES * index : VALUES * (index + 1)]
        )
        if slot.tensor == "grad_output":
            amax, scale_max, scale_min = amax / unscale, scale_max * unscale, scale_min * unscale
        ratio = underflowed / nonzero if nonzero > 0 else 0.0
        out.append(
            Fp8Tensor(
                layer=slot.layer,
                tensor=slot.tensor,
                cast=slot.cast,
                dtype=slot.dtype,
                rowwise=slot.rowwise,
                amax=_finite(amax),
                underflow_ratio=min(max(ratio, 0.0), 1.0) if math.isfinite(ratio) else 0.0,
                scale=_finite(scale_max),
                scale_min=_finite(scale_min),
                calls=calls,
            )
        )
    return out
