"""Which local parameters hold non-finite gradient values, and how many.

Runs only on iterations whose step was skipped for inf/NaN: one count per gradient
(segment) on the device and one host read per device. Clean iterations never come here.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ampscope.rank import compat
from ampscope.rank.gradients.names import ParamNames


def _local_values(grad: torch.Tensor) -> torch.Tensor:
    local = compat.local_tensor(grad)
    if local.is_sparse:
        # Sparse grads hold their values uncoalesced; counting the stored values is what
        # torch's own check looked at.
        return compat.sparse_values(local)
    return local


def count_nonfinite(optimizer: torch.optim.Optimizer, names: ParamNames) -> dict[str, int]:
    """Non-finite element counts of ``optimizer``'s local gradient shards, by parameter name.

    Cost: one ``isfinite`` pass per gradient and one host read per device (a sync on
    accelerators). Names without non-finite values are left out.
    """
    counts: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    labels: dict[torch.device, list[str]] = defaultdict(list)
    with torch.no_grad():
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                values = _local_values(param.grad)
                if values.numel() == 0:
                    continue
                nonfinite = torch.isfinite(values).logical_not_().reshape(-1)
                for segment in names.segments(param, g, i):
                    part = (
                        nonfinite
                        if segment.numel is None
                        else nonfinite[segment.offset : segment.offset + segment.numel]
                    )
                    counts[values.device].append(part.sum())
                    labels[values.device].append(segment.name)
    result: dict[str, int] = {}
    for device, tensors in counts.items():
        for name, count in zip(labels[device], torch.stack(tensors).tolist(), strict=True):
            if count:
                result[name] = result.get(name, 0) + int(count)
    return result


def top_k(counts: dict[str, int], k: int) -> list[tuple[str, int]]:
    """The ``k`` largest counts, largest first, ties by name."""
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]
