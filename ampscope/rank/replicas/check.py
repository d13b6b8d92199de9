"""The replica check: every ``N`` iterations, after the optimizer step, each rank compares
its parameters' fingerprints with its replicas' and every replica draws the same
conclusion.

Cost of a checking iteration: two kernels per bucket of parameters
(:mod:`ampscope.rank.replicas.fingerprint`), one ``all_gather`` of 8 bytes per chunk
(64 chunks per bucket) over the replica group, and one host read of the gathered
fingerprints (a host-device sync on accelerators). Other iterations cost a counter
increment: no kernel, no collective, no sync. Once chunks differ, a second gather of one
fingerprint per parameter overlapping them names the parameters.

Every rank of a replica group must call :meth:`ReplicaCheck.after_step` on the same
iterations (every ``update()``): the gathers pair up by call order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampscope.rank.replicas.fingerprint import FingerprintPlan
from ampscope.rank.replicas.groups import ReplicaSet, replica_sets
from ampscope.reporter.schema import (
    MAX_REPLICA_PARAMETERS,
    MAX_REPLICA_RANKS,
    ReplicaCheckResult,
)


@dataclass(frozen=True)
class ReplicaOutcome:
    """What one check found, the same on every replica of a group."""

    agree: bool
    replicas: int
    """Ranks compared (the largest replica group's size)."""
    ranks: tuple[int, ...] = ()
    """Global ranks that disagree: the minority where a majority agrees, else every
    rank of a group with no majority (two replicas, or a tie)."""
    majority: bool = True
    """Every differing fingerprint had a strict majority behind one value."""
    parameters: tuple[str, ...] = ()
    """Names of the differing parameters (at most ``MAX_REPLICA_PARAMETERS``)."""
    parameters_differing: int = 0

    def to_record(self) -> ReplicaCheckResult:
        return ReplicaCheckResult(
            agree=self.agree,
            replicas=self.replicas,
            ranks=list(self.ranks[:MAX_REPLICA_RANKS]),
            majority=self.majority,
            parameters=list(self.parameters[:MAX_REPLICA_PARAMETERS]),
            parameters_differing=self.parameters_differing,
        )


FAILED = -(2**63)
"""A replica's whole fingerprint row when it could not take it: the all-gather still pairs,
and every replica sees that one failed (no sum of bit patterns fills a row with it)."""


def _gather(local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Every replica's ``local`` vector, on the host, one row each in group order: one
    collective and one host read."""
    if dist.get_backend(group) == "gloo" and local.device.type != "cpu":
        local = local.cpu()  # gloo's all_gather takes host tensors
    out = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out.view(size, -1).cpu()


@dataclass(frozen=True)
class _Column:
    """One differing fingerprint: the group positions that disagree, and whether a strict
    majority held the other value."""

    positions: tuple[int, ...]
    majority: bool


def _judge(rows: torch.Tensor) -> dict[int, _Column]:
    """The differing columns of the gathered ``rows`` (replicas x fingerprints, on the
    host): one vectorised comparison; Python only over the columns that differ."""
    differing = (rows != rows[0]).any(0).nonzero().flatten().tolist()
    found: dict[int, _Column] = {}
    size = rows.shape[0]
    for col in differing:
        values = rows[:, col].tolist()
        counts: dict[int, int] = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        common, held = max(counts.items(), key=lambda kv: kv[1])
        if 2 * held > size:
            found[col] = _Column(tuple(i for i, v in enumerate(values) if v != common), True)
        else:  # no majority: every replica is in the disagreement
            found[col] = _Column(tuple(range(size)), False)
    return found


class _SetCheck:
    """The check of one replica set."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.plan = FingerprintPlan(replicas.pieces)

    def run(self) -> ReplicaOutcome | None:
        """The set's outcome; ``None`` when a replica could not take its fingerprints
        (every replica sees that alike). Raises on the replica that failed, after it took
        its part in the all-gather: a failure never leaves the others waiting in it."""
        ranks, group = self.replicas.ranks, self.replicas.group
        failed: Exception | None = None
        try:
            local = self.plan.chunks()
        except Exception as exc:  # e.g. out of memory for the packed copy
            failed = exc
            local = torch.full(
                (self.plan.size,), FAILED, dtype=torch.int64, device=self.plan.device
            )
        rows = _gather(local, group, len(ranks))
        if failed is not None:
            raise failed
        if bool((rows == FAILED).all(dim=1).any()):
            return None  # a replica could not fingerprint: no outcome this time
        chunks = _judge(rows)
        if not chunks:
            return ReplicaOutcome(agree=True, replicas=len(ranks))
        # Named: every replica saw the same rows, so all gather the same pieces here.
        indexes = self.plan.pieces_in(sorted(chunks))
        pieces = _judge(_gather(self.plan.segments(indexes), group, len(ranks)))
        differing = pieces or chunks
        positions = sorted({p for column in differing.values() for p in column.positions})
        names = [self.plan.pieces[indexes[i]].name for i in sorted(pieces)] if pieces else []
        if not names:  # the pieces agree on their own: name those of the chunks
            names = [self.plan.pieces[i].name for i in indexes]
        return ReplicaOutcome(
            agree=False,
            replicas=len(ranks),
            ranks=tuple(ranks[p] for p in positions),
            majority=all(column.majority for column in differing.values()),
            parameters=tuple(dict.fromkeys(names)),
            parameters_differing=len(dict.fromkeys(names)),
        )


class ReplicaCheck:
    """Compares this rank's parameters with its replicas' every ``every`` iterations.

    Args:
        model: The wrapped model (DDP, FSDP1, FSDP2), as given to ``attach``; ``None``
            with ``sets``.
        every: Check on every ``every``-th call of :meth:`after_step` (1-based).
        sets: The replica sets to compare, when the caller laid them out (DeepSpeed:
            :func:`~ampscope.rank.replicas.groups.deepspeed_sets`) instead of ``model``.
    """

    def __init__(
        self, model: nn.Module | None, every: int, *, sets: list[ReplicaSet] | None = None
    ) -> None:
        self.every = every
        self._calls = 0
        if sets is None:
            sets = [] if model is None else replica_sets(model)
        self._sets = [_SetCheck(s) for s in sets]

    @property
    def compares(self) -> bool:
        """Whether any parameter has a replica (else :meth:`after_step` never checks)."""
        return bool(self._sets)

    def after_step(self) -> ReplicaOutcome | None:
        """Call once per iteration, after the optimizer step(s), on every rank: the check's
        outcome on a checking iteration, ``None`` on the others (a counter increment)."""
        self._calls += 1
        if not self._sets or self._calls % self.every:
            return None
        outcomes: list[ReplicaOutcome] = []
        failed: Exception | None = None
        for check in self._sets:  # every set's collective, whatever failed before it
            try:
                outcome = check.run()
            except Exception as exc:
                failed = failed or exc
                continue
            if outcome is not None:
                outcomes.append(outcome)
        if failed is not None:
            raise failed
        if not outcomes:
            return None
        if len(outcomes) == 1:
            return outcomes[0]
        diverged = [o for o in outcomes if not o.agree]
        names = tuple(dict.fromkeys(n for o in diverged for n in o.parameters))
        return ReplicaOutcome(
            agree=not diverged,
            replicas=max(o.replicas for o in outcomes),
            ranks=tuple(sorted({r for o in diverged for r in o.ranks})),
            majority=all(o.majority for o in diverged),
            parameters=names,
            parameters_differing=sum(o.parameters_differing for o in diverged),
        )
