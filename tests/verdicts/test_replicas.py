"""The replica_divergence rule: silent while checks agree; names the minority, the first
step and the parameters; says when two replicas leave no majority; counts alone
(Prometheus) name the groups."""

from __future__ import annotations

from ampscope.verdicts.replicas import DivergenceDetail, ReplicaFacts, replica_divergence
from ampscope.verdicts.thresholds import Thresholds

T = Thresholds()


def _facts(rank: int, diverged: int = 0, first: DivergenceDetail | None = None) -> ReplicaFacts:
    device = f"GPU-{rank}"
    return ReplicaFacts(
        rank=rank, node=f"n{rank // 2}", diverged=diverged, first=first, device=device
    )


def test_silent_while_every_check_agrees() -> None:
    verdict = replica_divergence([_facts(r) for r in range(4)], T)
    assert verdict.status == "ok"
    assert verdict.evidence == {"ranks_affected": 0}


def test_a_minority_rank_is_named_with_its_device_step_and_parameters() -> None:
    first = DivergenceDetail(step=300, ranks=(2,), majority=True, parameters=("h.3.mlp.weight",))
    later = DivergenceDetail(step=400, ranks=(2,), majority=True, parameters=("h.3.mlp.weight",))
    ranks = [_facts(r, 2, first) for r in range(3)] + [_facts(3, 1, later)]
    verdict = replica_divergence(ranks, T)
    assert verdict.status == "critical"
    evidence = verdict.evidence
    assert evidence["ranks"] == [{"rank": 2, "node": "n1", "device": "GPU-2"}]
    assert (evidence["step"], evidence["parameters"], evidence["majority"]) == (
        300,
        ["h.3.mlp.weight"],
        True,
    )
    assert evidence["checks_diverged"] == 7
    summary = verdict.summary
    assert summary.startswith("rank 2 (device GPU-2) disagree(s) with the majority")
    assert "since step 300" in summary
    assert "restore from the last checkpoint saved before step 300" in summary
    assert "exclude the named device" in summary


def test_two_replicas_name_both_and_say_there_is_no_majority() -> None:
    pair = DivergenceDetail(step=8, ranks=(1, 3), majority=False, parameters=("0.weight",))
    ranks = [_facts(0), _facts(1, 1, pair), _facts(2), _facts(3, 1, pair)]
    verdict = replica_divergence(ranks, T)
    assert verdict.status == "critical"
    assert [e["rank"] for e in verdict.evidence["ranks"]] == [1, 3]
    assert verdict.evidence["majority"] is False
    assert "no majority" in verdict.summary
    assert "check every named device" in verdict.summary


def test_a_minority_rank_another_exporter_holds_is_named_by_rank() -> None:
    first = DivergenceDetail(step=8, ranks=(5,), majority=True, parameters=("w",))
    verdict = replica_divergence([_facts(0, 1, first), _facts(1, 1, first)], T)
    assert verdict.evidence["ranks"] == [{"rank": 5}]
    assert verdict.summary.startswith("rank 5 disagree(s)")


def test_counts_alone_name_the_ranks_whose_group_diverged() -> None:
    verdict = replica_divergence([_facts(0, 2), _facts(1, 2), _facts(2)], T)
    assert verdict.status == "critical"
    assert [e["rank"] for e in verdict.evidence["ranks"]] == [0, 1]
    assert verdict.evidence["checks_diverged"] == 4
    assert "step" not in verdict.evidence
