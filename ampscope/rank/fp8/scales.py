"""torchao's scale of an amax, reproduced on the host in pure Python.

The device ships amaxes only; the telemetry thread derives each scale from them here,
bit for bit what torchao's ``amax_to_scale`` (``torchao.float8.float8_utils``, 0.18)
returns: ``float32(fp8_max / max(amax, EPS))`` computed in float64, then, with
``round_scales_to_power_of_2``, ``exp2(floor(log2(scale)))`` in float32. Plain floats and
``struct``, no torch: the thread holds the GIL only for a few arithmetic operations.

torchao's power-of-two rounding takes the float32 ``log2`` of the scale, which rounds to
the integer ``k`` for a scale a few float32 ulps below ``2**k`` (the spacing of float32
near ``k`` is coarser than the distance): the result is then ``2**k``, above the scale,
not the exact power of two below it (``math.frexp`` would give). Reproduced here by
rounding ``math.log2`` to float32, which equals torch's float32 ``log2`` on the CPU at
every such point (``tests/rank/fp8/test_fp8_scales.py``); a device whose ``log2`` is less
accurate than half an ulp could round a few of those scales differently.
"""

from __future__ import annotations

import math
import struct

EPS = 1e-12
"""torchao's ``float8_utils.EPS``: the smallest amax a scale is derived from (checked
against torchao by the tests)."""

_FLOAT32 = struct.Struct("<f")


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as a Python float.

    Raises:
        OverflowError: ``value`` is finite and beyond float32's range.
    """
    result: float = _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    return result


def amax_to_scale(amax: float, fp8_max: float, power_of_2: bool) -> float:
    """torchao's ``amax_to_scale(amax, dtype, power_of_2)`` of one float32 ``amax``.

    Args:
        amax: The amax (a float32 value; NaN and inf as torchao takes them).
        fp8_max: The FP8 dtype's largest finite value (``torch.finfo(dtype).max``).
        power_of_2: ``round_scales_to_power_of_2``.
    """
    if math.isnan(amax):
        return math.nan
    # fp8_max / EPS is about 5.7e16 at most: always within float32's range.
    scale = float32(fp8_max / max(amax, EPS))
    if power_of_2 and scale > 0.0:
        # exp2(floor(log2(scale))), each step in float32 as torch does it.
        scale = math.ldexp(1.0, math.floor(float32(math.log2(scale))))
    return scale
