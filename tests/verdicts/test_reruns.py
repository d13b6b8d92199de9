"""The rerun rules: only ranks whose own result was flagged, named with what the source holds."""

from __future__ import annotations

from ampscope.verdicts.reruns import (
    RerunDetail,
    RerunFacts,
    reproducible_fault,
    transient_fault,
)
from ampscope.verdicts.thresholds import Thresholds

T = Thresholds()


def test_no_reruns_is_ok() -> None:
    for rule in (transient_fault, reproducible_fault):
        verdict = rule([RerunFacts(rank=0, node="n0", reruns=0)], T)
        assert verdict.status == "ok"
        assert verdict.evidence == {"ranks_affected": 0}
        assert verdict.thresholds == {"window_s": T.spike_verdict_window_s}


def test_transient_names_rank_node_device_and_step() -> None:
    facts = [
        RerunFacts(
            rank=1,
            node="n0",
            reruns=1,
            device="GPU-1",
            newest=RerunDetail(step=8, first_loss=0.5, second_loss=0.5, second_norm=2.0),
        ),
        RerunFacts(rank=3, node="n1", reruns=2, device="GPU-3", newest=RerunDetail(step=5)),
    ]
    verdict = transient_fault(facts, T)
    assert verdict.status == "critical"
    assert verdict.summary.startswith("rank 1 (node n0, device GPU-1): its result at step 8")
    assert "2 rank(s) had transient results" in verdict.summary
    assert verdict.evidence["ranks_affected"] == 2
    assert verdict.evidence["reruns"] == 3
    first = verdict.evidence["ranks"][0]
    assert first == {
        "rank": 1,
        "node": "n0",
        "reruns": 1,
        "device": "GPU-1",
        "step": 8,
        "first": {"loss": 0.5, "norm": None},
        "second": {"loss": 0.5, "norm": 2.0},
    }


def test_reproducible_is_a_warning_and_counts_alone_without_details() -> None:
    verdict = reproducible_fault([RerunFacts(rank=2, node="n0", reruns=1)], T)
    assert verdict.status == "warning"
    assert verdict.summary.startswith("the rerun reproduced rank 2's flagged result (node n0)")
    assert verdict.evidence["ranks"] == [{"rank": 2, "node": "n0", "reruns": 1}]
