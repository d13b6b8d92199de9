"""Which ranks must hold the same parameter values as this one, per parallelism.

After every optimizer step, the replicas of a parameter hold bit-identical values: the
same reduced gradients went through the same optimizer arithmetic. Who the replicas are
depends on how the model is wrapped:

- DDP: every rank of the DDP process group holds every parameter.
- FSDP2 ``fully_shard`` over a 2-D mesh (HSDP, replicate x shard): the ranks of the
  replicate dimension hold the same shard (a parameter's ``Replicate`` placement names
  the mesh dimension). A 1-D mesh that only shards holds no replica.
- FSDP1 ``HYBRID_SHARD``: the ranks of the inter-node group hold the same FlatParameter
  shards; ``NO_SHARD``: every rank of the process group holds them whole.
- DeepSpeed ZeRO 0-2: every rank of the data-parallel group holds the engine's module
  parameters whole after each step (ZeRO-1/2 all-gather the updated partitions); an MoE
  expert's, the ranks of its expert data-parallel group. The integration reads the groups
  (:func:`deepspeed_sets`). ZeRO-3 partitions them: no replica.
- Plain FSDP (``FULL_SHARD``, ``SHARD_GRAD_OP``, FSDP2 on a 1-D mesh), one rank, or a
  model with none of these wrappers: no parameter has a replica, there is nothing to
  compare, and the check does nothing.

Called once per ``attach``: walks ``named_parameters()`` once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampscope.rank import compat
from ampscope.rank.replicas.fingerprint import Piece, dense


@dataclass
class ReplicaSet:
    """Parameters this rank holds together with the same other ranks."""

    how: str
    """``ddp``, ``hsdp`` (FSDP2 2-D mesh), ``fsdp1_hybrid``, ``fsdp1_no_shard`` or
    ``deepspeed``."""
    group: Any
    """The process group of the replicas (this rank included)."""
    ranks: tuple[int, ...]
    """The replicas' global ranks, in the group's order."""
    pieces: list[Piece] = field(default_factory=list)


def _group_ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _whole(name: str, tensor: torch.Tensor) -> Piece:
    return Piece(name, tensor, 0, tensor.numel())


def _flat_pieces(name: str, param: torch.Tensor) -> list[Piece]:
    """An FSDP1 FlatParameter shard as its original parameters' pieces (plain name else)."""
    cleaned, is_flat = compat.clean_param_name(name)
    flat = compat.flat_param_segments(param) if is_flat else None
    if flat is None:
        return [_whole(cleaned or name, param)]
    return [Piece(cleaned + s.relative_name, param, s.offset, s.numel) for s in flat]


def replica_sets(model: nn.Module) -> list[ReplicaSet]:
    """The replica sets of ``model``'s parameters on this rank: empty when no parameter has
    a replica (see the module docstring). Every rank of a set builds its pieces in the
    same order.

    Raises:
        ValueError: the model holds several DDP wrappers or FSDP1 roots.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    from ampscope.rank.gradients.origin_hooks import find_ddp, find_fsdp1_root

    ddp = find_ddp(model)
    if ddp is not None:
        return _sized([_ddp_set(ddp)])
    root = find_fsdp1_root(model)
    if root is not None:
        group = compat.fsdp1_replica_group(root)
        if group is None:
            return []
        how = "fsdp1_no_shard" if group is root.process_group else "fsdp1_hybrid"
        replicas = ReplicaSet(how, group, _group_ranks(group))
        for name, param in model.named_parameters():
            replicas.pieces.extend(_flat_pieces(name, param))
        return _sized([replicas])
    return _sized(_dtensor_sets(model))


def _ddp_set(ddp: nn.Module) -> ReplicaSet:
    group = getattr(ddp, "process_group", None) or dist.group.WORLD
    replicas = ReplicaSet("ddp", group, _group_ranks(group))
    # Parameters DDP was told to leave alone (model-parallel parts) differ by design.
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    for name, param in ddp.module.named_parameters():  # type: ignore[union-attr]
        if name in ignored:
            continue
        replicas.pieces.append(_whole(compat.clean_param_name(name)[0], param))
    return replicas


def _dtensor_sets(model: nn.Module) -> list[ReplicaSet]:
    """FSDP2 (and any DTensor parameter with a ``Replicate`` placement): one set per
    replicate group."""
    sets: dict[int, ReplicaSet] = {}
    for name, param in model.named_parameters():
        group = compat.dtensor_replica_group(param)
        if group is None:
            continue
        replicas = sets.get(id(group))
        if replicas is None:
            replicas = sets[id(group)] = ReplicaSet("hsdp", group, _group_ranks(group))
        local = compat.local_tensor(param)
        replicas.pieces.append(_whole(compat.clean_param_name(name)[0], local))
    return list(sets.values())


def deepspeed_sets(params: Iterable[tuple[str, torch.Tensor, Any]]) -> list[ReplicaSet]:
    """DeepSpeed's replica sets: one per process group of ``params`` (name, parameter,
    the group that holds it whole, as the integration reads them from the engine), in
    the parameters' order; none on a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    sets: dict[int, ReplicaSet] = {}
    for name, param, group in params:
        replicas = sets.get(id(group))
        if replicas is None:
            replicas = sets[id(group)] = ReplicaSet("deepspeed", group, _group_ranks(group))
        replicas.pieces.append(_whole(name, param))
    return _sized(list(sets.values()))


def _sized(sets: list[ReplicaSet]) -> list[ReplicaSet]:
    """The sets with at least two replicas and a piece to compare; 1-byte parameters (FP8
    storage) are left out, as the fingerprints read 2- and 4-byte words, and so are
    parameters whose memory has gaps or overlaps (no view of it in place)."""
    for replicas in sets:
        replicas.pieces = [
            p for p in replicas.pieces if p.tensor.element_size() > 1 and dense(p.tensor)
        ]
    return [s for s in sets if len(s.ranks) > 1 and any(p.numel for p in s.pieces)]
