"""What a ``Float8Linear``'s cast does to one tensor: the few device ops it takes.

Each function returns a :class:`CastStats`: four float32 tensors of one element each,
built from device ops only (no ``.item()``, no sync), and what the host needs to decode
them. Eager FP8 steps on a GPU are bound by kernel launches, so everything that is a
function of a few scalars is left to the host (:mod:`ampscope.rank.fp8.record`): the
scale (:func:`ampscope.rank.fp8.scales.amax_to_scale` of the shipped amaxes) and the
ratio. The counts are int64 (exact at any size; a float32 count stops at 2**24), and the
underflowed are counted directly (non-zero and at or below the threshold).

The device computes, per tensor: the amax (rowwise: the smallest and largest row amax,
whose scales are the largest and smallest), the non-zero count, and how many elements
are at most the cast's threshold: an element ``x`` becomes zero in FP8 when
``|x * scale|`` is at most half the dtype's smallest subnormal ``h`` (round to nearest
even: the tie goes to zero), which is tested as ``|x| <= h / scale``, without building
the FP8 tensor. ``h / scale`` is ``max(amax, EPS) * (h / fp8_max)`` in float32 for
torchao's default scales (a float32 rounding away from ``h / scale``: only an element
within an ulp of the threshold can be counted differently), and exactly ``h / scale``
with torchao's own float32 steps for power-of-two scales. Tensorwise: 7 ops (two norms,
two for the threshold, ``abs``, ``le``, ``sum``).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch

from ampscope.rank.compat import Float8Cast
from ampscope.rank.fp8.scales import EPS, float32

VALUES = 4
"""Values per observed tensor: high, underflowed, nonzero, low (:class:`CastStats`)."""

Source = Literal["amax", "scale", "fp8_zeros"]


class CastStats(NamedTuple):
    """One cast's statistics: device tensors of shape ``[1]`` (float32), host metadata.

    ``source`` says what ``high`` and ``low`` hold: ``amax``, the largest and smallest
    amax (rowwise: of the rows; tensorwise both the amax); ``scale``, the largest and
    smallest scale of a weight that arrived cast (FSDP2's float8 all-gather); for
    ``fp8_zeros`` (no high-precision shard to count on) also the scale, with
    ``underflowed`` the FP8 data's zeros and ``nonzero`` unused.
    """

    high: torch.Tensor
    underflowed: torch.Tensor
    """Non-zero elements with ``|x|`` at most the threshold: those the cast makes zero."""
    nonzero: torch.Tensor
    low: torch.Tensor
    numel: int
    source: Source

    @property
    def values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``VALUES`` device values, in their order in the shipped vector."""
        return self.high, self.underflowed, self.nonzero, self.low


@functools.cache
def half_subnormal(dtype: torch.dtype) -> float:
    """Half the smallest positive value of an FP8 dtype (bit pattern 1): the largest
    magnitude its cast rounds to zero (a power of two)."""
    smallest = torch.tensor([1], dtype=torch.uint8).view(dtype).float().item()
    return smallest / 2


@functools.lru_cache(maxsize=32)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 ``[value]`` on ``device``, made once (one fill): a tensor numerator lets
    ``torch.div`` divide in one correctly rounded op (a Python one takes two)."""
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _float32_norm(
    tensor: torch.Tensor, order: float, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """``linalg.vector_norm`` (one reduction, no ``abs`` copy), in float32 for low
    precision inputs (CUDA reads them in the reduction itself)."""
    wide = tensor.dtype in (torch.float32, torch.float64)
    dtype = None if wide else torch.float32
    return torch.linalg.vector_norm(tensor, order, dim=dim, keepdim=keepdim, dtype=dtype)


def _threshold(amax: torch.Tensor, cast: Float8Cast) -> torch.Tensor:
    """``h / scale`` of the scale torchao derives from ``amax`` (any shape, float32)."""
    half = half_subnormal(cast.dtype)
    fp8_max = torch.finfo(cast.dtype).max
    if not cast.power_of_2:
        factor = half / fp8_max
        return (amax * factor).clamp_(min=EPS * factor)
    # torchao: float32(fp8_max / clamp(amax, EPS)) in float64, whose result is the float32
    # division's (float64 holds over twice float32's digits: rounding twice is innocuous);
    # clamping the quotient at fp8_max / EPS is clamping the amax at EPS.
    scale = torch.div(_constant(fp8_max, amax.device), amax)
    exponent = scale.clamp_(max=float32(fp8_max / EPS)).log2_().floor_()
    # The scale is exp2(exponent); h / scale is exactly exp2(log2(h) - exponent).
    return (math.log2(half) - exponent).exp2_()


def _counts(
    tensor: torch.Tensor,
    threshold: torch.Tensor,
    high: torch.Tensor,
    low: torch.Tensor,
    source: Source = "amax",
) -> CastStats:
    # Counts in int64 (count_nonzero): a float32 count stops at 2**24, where an
    # 8x2048x4096 activation holds 2**26 elements. The underflowed are counted directly, the
    # non-zero magnitudes at or below the threshold, not as a difference of two large
    # counts. abs in the tensor's dtype, compared in float32 (the threshold has a dim, so it
    # sets the comparison's dtype), those above it zeroed in place.
    nonzero = torch.count_nonzero(tensor).float().reshape(1)
    # An inf/NaN amax gives no threshold: nothing counts as underflowed (a NaN threshold
    # would keep every element below it, and count them all). One op on the threshold's
    # few elements.
    threshold = torch.nan_to_num(threshold, nan=-1.0, posinf=-1.0, neginf=-1.0)
    magnitude = tensor.abs()
    magnitude.masked_fill_(magnitude > threshold, 0.0)
    underflowed = torch.count_nonzero(magnitude).float().reshape(1)
    return CastStats(high, underflowed, nonzero, low, tensor.numel(), source)


@torch.no_grad()
def cast_stats(tensor: torch.Tensor, cast: Float8Cast) -> CastStats:
    """The statistics of ``cast`` applied to ``tensor`` (high precision), with the scale the
    layer derives from it. Cost: three reductions over the tensor (amax, non-zero count,
    underflowed count), an elementwise ``abs``, comparison and masked fill, and two (six
    for power-of-two scales) ops on the amax."""
    tensor = tensor.detach()
    if cast.rowwise:
        row_amax = _float32_norm(tensor, math.inf, dim=cast.row_dim, keepdim=True)
        low, high = torch.aminmax(row_amax.reshape(-1), dim=0, keepdim=True)
        threshold = _threshold(row_amax, cast)
    else:
        high = low = _float32_norm(tensor, math.inf).reshape(1)
        threshold = _threshold(high, cast)
    return _counts(tensor, threshold, high, low)


@torch.no_grad()
def precast_stats(
    shard: torch.Tensor | None, data: torch.Tensor, scale: torch.Tensor, cast: Float8Cast
) -> CastStats:
    """The statistics of a weight that reached the layer already cast (FSDP2's float8
    all-gather): the cast used the amax reduced over every shard, whose scale is shipped
    (the host derives the amax from it); the underflow is counted on this rank's own
    high-precision ``shard`` with that scale, which is the cast this rank ran. Without a
    shard, the gathered FP8 ``data``'s zeros count as underflowed (a weight element that
    was exactly zero counts too), of all its elements."""
    scale = scale.detach().float().reshape(1)
    if shard is None:
        zeros = (data == 0).sum().float().reshape(1)
        return CastStats(scale, zeros, zeros, scale, data.numel(), "fp8_zeros")
    # h / scale in one correctly rounded division.
    threshold = torch.div(_constant(half_subnormal(cast.dtype), scale.device), scale)
    return _counts(shard.detach(), threshold, scale, scale, "scale")
