"""The host's scale (``scales.amax_to_scale``) is torchao's ``amax_to_scale`` bit for bit,
and the device's threshold for power-of-two scales is exactly ``h / scale``."""

from __future__ import annotations

import math
import struct

import pytest
import torch

float8_utils = pytest.importorskip("torchao.float8.float8_utils")

from ampscope.rank.compat import Float8Cast  # noqa: E402
from ampscope.rank.fp8 import casts, scales  # noqa: E402

DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(value: float) -> bytes:
    return struct.pack("<f", value)


def _float32_neighbours(value: float, count: int) -> list[float]:
    """``value`` (a float32) and the ``count`` float32 values on each side of it."""
    bits = torch.tensor([value], dtype=torch.float32).view(torch.int32).item()
    around = torch.arange(bits - count, bits + count + 1, dtype=torch.int32)
    return [v for v in around.view(torch.float32).tolist() if math.isfinite(v) and v >= 0]


def _amaxes(dtype: torch.dtype) -> list[float]:
    """Random amaxes over float32's range, the edges, and the amaxes whose scale lands a
    few ulps around a power of two (where torchao's float32 log2 rounds up)."""
    fp8_max = torch.finfo(dtype).max
    generator = torch.Generator().manual_seed(0)
    out = (10.0 ** (torch.rand(5_000, generator=generator) * 80 - 45)).tolist()
    f32 = torch.finfo(torch.float32)
    out += [0.0, math.inf, math.nan, f32.max, f32.tiny, 1e-45, 1e-40, 1e-30, 1e-13]
    out += [torch.finfo(torch.bfloat16).max, 1.0, fp8_max, 3e38]
    out += _float32_neighbours(scales.float32(scales.EPS), 8)
    out += [2.0**k for k in range(-149, 128)]
    for k in range(-120, 56):
        # the amax of a scale 2**k, and its neighbours: their scales straddle 2**k
        amax = fp8_max / 2.0**k
        if amax < f32.max:
            out += _float32_neighbours(scales.float32(amax), 48)
    return [scales.float32(v) if math.isfinite(v) else v for v in out]


def test_eps_is_torchaos() -> None:
    assert scales.EPS == float8_utils.EPS


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_scale_is_torchaos_bit_for_bit(dtype: torch.dtype, power_of_2: bool) -> None:
    amaxes = _amaxes(dtype)
    fp8_max = torch.finfo(dtype).max
    theirs = float8_utils.amax_to_scale(torch.tensor(amaxes), dtype, power_of_2).tolist()
    # torch's scalar path (a 0-dim amax: tensorwise) as well as its vectorised one
    for amax in amaxes[::97]:
        one = float8_utils.amax_to_scale(torch.tensor(amax), dtype, power_of_2).item()
        assert _bits(scales.amax_to_scale(amax, fp8_max, power_of_2)) == _bits(one), amax
    mismatched = [
        (amax, mine, their)
        for amax, their in zip(amaxes, theirs, strict=True)
        if _bits(mine := scales.amax_to_scale(amax, fp8_max, power_of_2)) != _bits(their)
    ]
    assert not mismatched, mismatched[:5]
    if power_of_2:  # the rounding up below a power of two is real, and reproduced
        rounded_up = [
            (a, s) for a, s in zip(amaxes, theirs, strict=True) if s > 0 and s * a > fp8_max
        ]
        assert rounded_up


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_threshold_of_power_of_2_scales_is_exact(dtype: torch.dtype) -> None:
    cast = Float8Cast("input", dtype, rowwise=True, row_dim=-1, power_of_2=True)
    amaxes = torch.tensor([a for a in _amaxes(dtype) if not math.isnan(a)])
    threshold = casts._threshold(amaxes.reshape(-1, 1), cast).reshape(-1)
    scale = float8_utils.amax_to_scale(amaxes, dtype, True)
    assert torch.equal(threshold, casts.half_subnormal(dtype) / scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_threshold_of_other_scales_is_h_over_scale_to_an_ulp(dtype: torch.dtype) -> None:
    cast = Float8Cast("input", dtype, rowwise=False, row_dim=-1, power_of_2=False)
    amaxes = torch.tensor([a for a in _amaxes(dtype) if math.isfinite(a)])
    threshold = casts._threshold(amaxes, cast)
    expected = casts.half_subnormal(dtype) / float8_utils.amax_to_scale(amaxes, dtype, False)
    torch.testing.assert_close(threshold, expected, rtol=3e-7, atol=0.0)


def test_counts_stay_exact_past_float32s_integers() -> None:
    """A tensor of more than 2**24 elements (an 8x2048x4096 activation holds 2**26): both
    counts stay exact (a float32 count stops at 2**24 on a one-thread reduction, and a
    difference of two such counts was off, even negative)."""
    dtype = torch.float8_e4m3fn
    cast = Float8Cast("input", dtype, rowwise=False, row_dim=-1, power_of_2=False)
    tensor = torch.ones(2**25 + 3, dtype=torch.bfloat16)
    tensor[:5] = 0.0
    tensor[5:12] = 1e-30  # far below what a scale of fp8_max / 1 keeps: underflows
    stats = casts.cast_stats(tensor, cast)
    assert stats.underflowed.item() == 7.0
    assert stats.nonzero.item() == float(2**25 + 3 - 5)  # even: float32 holds it exactly
