"""Unscaling DTensor gradients on their local shards, keeping the pre-reduction found-inf.

With FSDP2 (``fully_shard``) or tensor parallelism the gradients are DTensors, and
DTensor's dispatch of the unscale kernel runs it on the local shards and then
all-reduces found-inf at once, so the rank-local answer never exists. Here torch's
own ``_unscale_grads_`` runs on a stand-in optimizer whose parameters expose the local
shards (same kernel, same single pass over gradient memory), the local found-inf is
kept, and the reduction is then done exactly as DTensor's dispatch does it: for each
(device, dtype) group in torch's order, max-reduce over the mesh of the group's first
grad, ``Partial("max")`` on every non-replicated mesh dimension. The values returned
are equal to torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampscope.rank import compat

UnscaleFn = Callable[[Any, torch.Tensor, torch.Tensor, bool], dict[torch.device, torch.Tensor]]
"""torch's ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``, bound."""


@dataclass
class _Group:
    reduction: compat.FoundInfReduction | None
    stand_ins: list[torch.Tensor] = field(default_factory=list)


class _LocalShardsView:
    """Quacks like an optimizer for ``_unscale_grads_``: one group of stand-in tensors
    whose ``.grad`` is a DTensor gradient's local shard (views, no copies)."""

    def __init__(self, stand_ins: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": stand_ins}]


def unscale_local_shards(
    unscale: UnscaleFn,
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> tuple[dict[torch.device, torch.Tensor], dict[torch.device, torch.Tensor]]:
    """Unscale ``optimizer``'s gradients in place; return (reduced, local) found-inf per device.

    ``reduced`` equals what torch's ``_unscale_grads_`` returns for DTensor grads; runs
    the same collectives (one per group with DTensor grads).
    """
    groups: dict[torch.device, dict[torch.dtype, _Group]] = {}
    with torch.no_grad():
        for param_group in optimizer.param_groups:
            for param in param_group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                local = compat.local_tensor(grad)
                group = groups.setdefault(local.device, {}).get(local.dtype)
                if group is None:
                    group = groups[local.device][local.dtype] = _Group(reduction=None)
                if group.reduction is None and compat.is_dtensor(grad):
                    group.reduction = compat.found_inf_reduction(grad)
                stand_in = local.detach()
                stand_in.grad = local
                group.stand_ins.append(stand_in)

        reduced: dict[torch.device, torch.Tensor] = {}
        local_found: dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in groups.items():
            for group in per_dtype.values():
                flags = unscale(_LocalShardsView(group.stand_ins), inv_scale, found_inf, allow_fp16)
                flag = flags[device]
                previous_local = local_found.get(device)
                local_found[device] = (
                    flag.clone() if previous_local is None else torch.maximum(previous_local, flag)
                )
                previous = reduced.get(device)
                combined = flag if previous is None else torch.maximum(previous, flag)
                if group.reduction is not None:
                    compat.reduce_found_inf(combined, group.reduction)
                reduced[device] = combined
    return reduced, local_found
