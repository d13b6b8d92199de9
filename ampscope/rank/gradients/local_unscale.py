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
from typing import Any

import torch

from ampscope.rank import compat
from ampscope.rank.gradients.nonfinite import group_by_place

UnscaleFn = Callable[[Any, torch.Tensor, torch.Tensor, bool], dict[torch.device, torch.Tensor]]
"""torch's ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``, bound."""


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
    stand_ins: list[torch.Tensor] = []
    dtensors: dict[int, torch.Tensor] = {}  # a stand-in's DTensor gradient, by its id()
    with torch.no_grad():
        for param_group in optimizer.param_groups:
            for param in param_group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                local = compat.local_tensor(grad)
                stand_in = local.detach()  # the local shard's device and dtype
                stand_in.grad = local
                stand_ins.append(stand_in)
                if compat.is_dtensor(grad):
                    dtensors[id(stand_in)] = grad

        reduced: dict[torch.device, torch.Tensor] = {}
        local_found: dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in group_by_place(stand_ins).items():
            for group in per_dtype.values():
                flags = unscale(_LocalShardsView(group), inv_scale, found_inf, allow_fp16)
                flag = flags[device]
                previous_local = local_found.get(device)
                local_found[device] = (
                    flag.clone() if previous_local is None else torch.maximum(previous_local, flag)
                )
                previous = reduced.get(device)
                combined = flag if previous is None else torch.maximum(previous, flag)
                first = next((dtensors[id(s)] for s in group if id(s) in dtensors), None)
                if first is not None:
                    compat.reduce_found_inf(combined, compat.found_inf_reduction(first))
                reduced[device] = combined
    return reduced, local_found
