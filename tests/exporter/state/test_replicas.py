"""A rank's replica checks in the exporter: counts by result, the first divergence, and the
device offence of an outvoted rank only."""

from __future__ import annotations

from ampscope.exporter.state.replicas import RankReplicas, replica_offended
from ampscope.reporter.schema import ReplicaCheckResult, StepRecord
from exporter.factory import record


def _checked(step: int, rank: int, check: ReplicaCheckResult) -> StepRecord:
    return record(step, rank=rank, world_size=4).model_copy(update={"replicas": check})


AGREE = ReplicaCheckResult(agree=True, replicas=4)
OUTVOTED = ReplicaCheckResult(
    agree=False, replicas=4, ranks=[2], parameters=["w"], parameters_differing=1
)
PAIR = ReplicaCheckResult(
    agree=False, replicas=2, ranks=[1, 3], majority=False, parameters=["w"], parameters_differing=1
)


def test_counts_the_first_divergence_and_the_outvoted_ranks_offences() -> None:
    for rank in range(4):
        replicas = RankReplicas()
        replicas.observe(record(1, rank=rank), 1.0)  # no check: nothing
        replicas.observe(_checked(2, rank, AGREE), 2.0)
        replicas.observe(_checked(4, rank, OUTVOTED), 4.0)
        replicas.observe(_checked(6, rank, OUTVOTED), 6.0)
        assert tuple(replicas.counts) == (1, 2)
        assert replicas.first is not None
        assert (replicas.first.step, replicas.first.ranks, replicas.first.received) == (
            4,
            (2,),
            4.0,
        )
        assert replicas.offences == (2 if rank == 2 else 0)
        replicas.reset()  # restored from a checkpoint: a new process
        assert (tuple(replicas.counts), replicas.first, replicas.offences) == ((0, 0), None, 0)


def test_without_a_majority_no_device_is_blamed() -> None:
    assert replica_offended(_checked(4, 2, OUTVOTED))
    assert not replica_offended(_checked(4, 1, OUTVOTED))
    assert not replica_offended(_checked(4, 1, PAIR))
    assert not replica_offended(_checked(4, 3, PAIR))
    assert not replica_offended(_checked(4, 2, AGREE))
