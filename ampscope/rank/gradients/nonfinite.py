"""Found-inf flags: finding inf/NaN in this rank's local gradients, and combining flags.

A found-inf flag is a one-element float32 tensor on a device, 1 when some gradient on it
held inf/NaN, else 0 (torch's scaler keeps one per device; so do the captures). Here:

* :func:`group_by_place`: gradients grouped by device, then dtype, as torch's unscale
  groups them (one fused kernel per group);
* :func:`check_local`: a watch's check, torch's fused non-finite kernel (the one its
  unscale runs) with an inverse scale of 1, once per group of local gradients;
* :func:`max_of`, :func:`max_per_device`: several flags made one (per device).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ampscope.rank import compat

if TYPE_CHECKING:
    from ampscope.rank.capture.registry import OptimizerInfo

FoundInf = Mapping[torch.device, torch.Tensor]
"""Found-inf flags by device."""

PlaceGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
"""Tensors by device, then by dtype, each in first-seen order."""


def group_by_place(tensors: Iterable[torch.Tensor]) -> PlaceGroups:
    """``tensors`` grouped by device, then dtype, in the order torch's unscale groups its
    gradients (devices and dtypes in first-seen order)."""
    groups: PlaceGroups = {}
    for tensor in tensors:
        per_dtype = groups.get(tensor.device)
        if per_dtype is None:
            per_dtype = groups[tensor.device] = {}
        same = per_dtype.get(tensor.dtype)
        if same is None:
            per_dtype[tensor.dtype] = [tensor]
        else:
            same.append(tensor)
    return groups


def max_of(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flag set when any of ``flags`` is: the first itself when it is alone, else a new
    tensor on the first one's device (one small op per further flag; none written)."""
    merged = flags[0]
    for flag in flags[1:]:
        merged = torch.maximum(merged, flag.to(merged.device))
    return merged


def max_per_device(founds: Sequence[FoundInf]) -> FoundInf:
    """Per device, one flag set when any of ``founds`` holds a set flag for it: the one
    mapping itself when there is one (the common single optimizer), else devices in
    first-seen order."""
    if len(founds) == 1:
        return founds[0]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for found in founds:
        for device, flag in found.items():
            same = by_device.get(device)
            if same is None:
                by_device[device] = [flag]
            else:
                same.append(flag)
    return {device: max_of(flags) for device, flags in by_device.items()}


def check_local(
    optimizer: torch.optim.Optimizer,
    info: OptimizerInfo,
    ones: dict[torch.device, torch.Tensor],
) -> dict[torch.device, torch.Tensor]:
    """This rank's found-inf per device for ``optimizer``'s local gradients.

    Groups the gradients by device and dtype as torch's unscale does (sparse ones by their
    stored values, DTensors by their local shards) and runs the fused kernel once per
    group, into one zeroed flag per device. ``ones`` caches the inverse scale of 1 per
    device. Cost: one Python walk over the parameters, one small fill per device, one
    kernel per group; no sync.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    place = info.place
    if place is not None:
        # One device and dtype, known from the parameters: one group, unless sparse.
        dense = [g for g in grads if g is not None]
        if not any(g.is_sparse for g in dense):
            device = place[0]
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            if dense:
                _check_group(dense, flag, _one_on(device, ones))
            return {device: flag}
    found: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in group_by_place(_local_values(grads, info.dtensor)).items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for same in per_dtype.values():
            _check_group(same, flag, _one_on(device, ones))
        found[device] = flag
    return found


def _local_values(grads: list[torch.Tensor | None], dtensor: bool) -> Iterable[torch.Tensor]:
    """What the kernel checks of each gradient: its local shard, a sparse one's values."""
    for grad in grads:
        if grad is None:
            continue
        local = compat.local_tensor(grad) if dtensor else grad
        yield compat.sparse_values(local) if local.is_sparse else local


def _one_on(device: torch.device, ones: dict[torch.device, torch.Tensor]) -> torch.Tensor:
    one = ones.get(device)
    if one is None:
        one = ones[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def _check_group(grads: list[torch.Tensor], flag: torch.Tensor, one: torch.Tensor) -> None:
    # Gradients that require grad themselves (create_graph=True) must not record the
    # kernel; entering no_grad costs more than the kernel, so only for those.
    if torch.is_grad_enabled() and any(g.requires_grad for g in grads):
        with torch.no_grad():
            compat.non_finite_check_(grads, flag, one)
    else:
        compat.non_finite_check_(grads, flag, one)
