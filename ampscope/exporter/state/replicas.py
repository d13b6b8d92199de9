"""The replica checks of one rank (``attach(model, replica_check_every=N)``): how many
agreed and diverged, the first that diverged, for ``ampscope_replica_checks_total``, the
``replica_divergence`` verdict and the device offences (``ampscope_device_offences_total``
kind ``replica_divergence``).

Every rank of a replica group records the same outcome of each check, so each counts
its group's checks. The device offence is the minority's only: a rank counts one for a
diverged check that a strict majority of its replicas outvoted it in. Without a majority
(two replicas, a tie) no device is blamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

from ampscope.reporter.schema import StepRecord

ReplicaResult = Literal["agree", "diverged"]
"""The ``result`` label of ``ampscope_replica_checks_total``."""

REPLICA_RESULTS: tuple[ReplicaResult, ...] = get_args(ReplicaResult)


class ReplicaCounts(NamedTuple):
    """Replica checks of one rank's group since the exporter first heard its current
    process."""

    agree: int = 0
    diverged: int = 0


NO_REPLICA_CHECKS = ReplicaCounts()


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first check of the rank's current process whose replicas disagreed."""

    step: int
    ranks: tuple[int, ...]
    """The disagreeing global ranks (the minority, or all of them without a majority)."""
    majority: bool
    parameters: tuple[str, ...]
    parameters_differing: int
    replicas: int
    received: float
    """Exporter clock when it arrived."""


def replica_offended(record: StepRecord) -> bool:
    """Whether ``record``'s replica check outvoted its own rank: a strict majority of its
    replicas held other values (its device computed or kept them wrongly)."""
    check = record.replicas
    return (
        check is not None
        and not check.agree
        and check.majority
        and record.identity.rank in check.ranks
    )


class RankReplicas:
    """A rank's replica-check counters and first divergence; fed the rank's newest records
    in step order (the store's lock held). O(1) per record."""

    def __init__(self) -> None:
        self.counts = NO_REPLICA_CHECKS
        self.first: Divergence | None = None
        self.offences = 0
        """Diverged checks in which a majority outvoted this rank."""

    def observe(self, record: StepRecord, now: float) -> None:
        check = record.replicas
        if check is None:
            return
        if check.agree:
            self.counts = self.counts._replace(agree=self.counts.agree + 1)
            return
        self.counts = self.counts._replace(diverged=self.counts.diverged + 1)
        self.offences += replica_offended(record)
        if self.first is None:
            self.first = Divergence(
                step=record.step,
                ranks=tuple(check.ranks),
                majority=check.majority,
                parameters=tuple(check.parameters),
                parameters_differing=check.parameters_differing,
                replicas=check.replicas,
                received=now,
            )

    def reset(self) -> None:
        """A new process of the rank (restored from a checkpoint): it starts agreeing."""
        self.counts = NO_REPLICA_CHECKS
        self.first = None
        self.offences = 0
