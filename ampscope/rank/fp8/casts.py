"""What a ``Float8Linear``'s cast does to one tensor, computed on the tensor's device.

Each function returns a float32 vector ``[amax, underflowed, nonzero, scale_max,
scale_min]`` built from device ops only (no ``.item()``, no sync): the amax, how many of
the tensor's non-zero elements the cast turns into zero, how many are non-zero, and the
largest and smallest scale (equal for tensorwise scaling).

The scale is torchao's own (``amax_to_scale`` of the amax the layer computes); an element
``x`` becomes zero in FP8 exactly when ``|x * scale|`` is at most half the dtype's
smallest subnormal (round to nearest even: the tie goes to zero), which is what the cast's
rounding does, without building the FP8 tensor.
"""

from __future__ import annotations

import functools

import torch

from ampscope.rank import compat
from ampscope.rank.compat import Float8Cast

VALUES = 5
"""Values per observed tensor: amax, underflowed, nonzero, scale_max, scale_min."""


@functools.cache
def half_subnormal(dtype: torch.dtype) -> float:
    """Half the smallest positive value of an FP8 dtype (bit pattern 1): the largest
    magnitude its cast rounds to zero."""
    smallest = torch.tensor([1], dtype=torch.uint8).view(dtype).float().item()
    return smallest / 2


@torch.no_grad()
def cast_stats(tensor: torch.Tensor, cast: Float8Cast) -> torch.Tensor:
    """The statistics of ``cast`` applied to ``tensor`` (high precision), with the scale the
    layer derives from it. Cost: one float32 copy of the tensor, a reduction for the amax
    and two counts."""
    # copy=True: a float32 tensor's .float() is the tensor itself, and abs_ must not touch it.
    magnitude = tensor.detach().to(torch.float32, copy=True).abs_()
    if cast.rowwise:
        row_amax = magnitude.amax(dim=cast.row_dim, keepdim=True)
        scale = compat.float8_amax_to_scale(row_amax, cast)
        amax = row_amax.max()
        scale_max, scale_min = scale.max(), scale.min()
    else:
        amax = magnitude.max()
        scale = scale_max = scale_min = compat.float8_amax_to_scale(amax, cast)
    return _stack(magnitude, scale, amax, scale_max, scale_min, cast.dtype)


@torch.no_grad()
def precast_stats(
    shard: torch.Tensor | None, data: torch.Tensor, scale: torch.Tensor, cast: Float8Cast
) -> torch.Tensor:
    """The statistics of a weight that reached the layer already cast (FSDP2's float8
    all-gather): the amax the cast used is the one reduced over every shard, read back from
    its scale; the underflow is counted on this rank's own high-precision ``shard`` with
    that scale, which is the cast this rank ran. Without a shard, the gathered FP8 ``data``'s
    zeros count as underflowed (a weight element that was exactly zero counts too)."""
    scale = scale.detach().float().reshape(())
    amax = torch.finfo(cast.dtype).max / scale
    if shard is None:
        zeros = (data == 0).sum()
        numel = torch.tensor(float(data.numel()), device=scale.device)
        return torch.stack([amax, zeros.float(), numel, scale, scale])
    magnitude = shard.detach().float().abs()
    return _stack(magnitude, scale, amax, scale, scale, cast.dtype)


def _stack(
    magnitude: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    scale_max: torch.Tensor,
    scale_min: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    nonzero = torch.count_nonzero(magnitude)
    zero_before = magnitude.numel() - nonzero
    # |x| <= h / scale rather than |x * scale| <= h: one pass over the tensor fewer.
    zero_after = (magnitude <= half_subnormal(dtype) / scale).sum()
    underflowed = zero_after - zero_before
    return torch.stack(
        [
            amax.float(),
            underflowed.float(),
            nonzero.float(),
            scale_max.float().reshape(()),
            scale_min.float().reshape(()),
        ]
    )
