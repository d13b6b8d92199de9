"""An observed iteration's FP8 values, on the host, as the records' ``fp8`` entries.

Runs on the telemetry thread. Under a loss scaler the ``grad_output`` the layer cast was
the scaled gradient: its amax is divided by the iteration's loss scale and its scale
multiplied by it, so that every value describes the unscaled gradient (the underflow ratio
does not change with the loss scale: the cast's own scale follows it).
"""

from __future__ import annotations

import math

from ampscope.rank.fp8.casts import VALUES
from ampscope.rank.fp8.observer import Fp8Taken
from ampscope.reporter.schema import Fp8Tensor


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def fp8_entries(taken: Fp8Taken, values: list[float], loss_scale: float) -> list[Fp8Tensor]:
    """The entries of one observed iteration.

    Args:
        taken: What names the values (``PendingStep.fp8``).
        values: Their host values, ``VALUES`` per slot.
        loss_scale: The loss scale ``grad_output`` carries (1 without a scaler).
    """
    unscale = loss_scale if math.isfinite(loss_scale) and loss_scale > 0 else 1.0
    out = []
    for index, (slot, calls) in enumerate(zip(taken.slots, taken.calls, strict=True)):
        amax, underflowed, nonzero, scale_max, scale_min = values[
            VALUES * index : VALUES * (index + 1)
        ]
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
