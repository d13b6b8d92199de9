"""The shared rules over the neutral view of ranks, as ``ampscope status``'s merged view
calls them (the exporter's path is in test_health)."""

from __future__ import annotations

from ampscope.verdicts.rules import (
    NO_SCALE,
    AlignedFacts,
    InfFacts,
    RankFacts,
    RankStateName,
    Thresholds,
    aligned_scale_desync,
    declared_world_size,
    inf_hotspot,
    lost_rank,
    missing_rank,
    missing_ranks,
    whole_job,
)


def _facts(
    rank: int,
    *,
    node: str = "n0",
    state: RankStateName = "running",
    world_size: int = 8,
    local_world_size: int | None = 4,
    heard: float = 100.0,
) -> RankFacts:
    return RankFacts(
        rank=rank,
        node=node,
        state=state,
        world_size=world_size,
        local_world_size=local_world_size,
        last_step=10 + rank,
        last_report_time=heard,
        seconds_since_report=200.0 - heard,
    )


def test_missing_ranks_against_the_newest_declared_world_size() -> None:
    ranks = [_facts(r, node=f"n{r // 4}") for r in (0, 1, 2, 3, 5, 7)]
    assert missing_ranks(ranks) == [4, 6]
    assert missing_ranks([]) == []
    # After an elastic resize to 4, a rank of the old size heard long ago does not count.
    resized = [_facts(r, world_size=4, heard=150.0) for r in (0, 1)] + [_facts(6, heard=90.0)]
    assert declared_world_size(resized) == 4
    assert missing_ranks(resized) == [2, 3]
    verdict = missing_rank(resized, judged=True)
    assert verdict.evidence == {
        "judged": True,
        "world_size": 4,
        "seen": 2,
        "missing": 2,
        "ranks": [2, 3],
    }


def test_a_missing_rank_is_a_warning_never_critical() -> None:
    one_of_eight = [_facts(0)]
    verdict = missing_rank(one_of_eight, judged=True)
    assert (verdict.rule, verdict.status) == ("missing_rank", "warning")
    assert verdict.evidence["missing"] == 7
    assert "7 of 8 rank(s) never reported" in verdict.summary
    assert "rank(s) 1, 2, 3, 4, 5, 6, 7" in verdict.summary
    # Thousands missing: the evidence and summary list the first 16, the count says all.
    huge = missing_rank([_facts(0, world_size=8192)], judged=True)
    assert huge.evidence["missing"] == 8191
    assert huge.evidence["ranks"] == list(range(1, 17))
    assert huge.summary.endswith("and 8175 more")
    assert missing_rank([], judged=True).status == "ok"
    # Unjudged: ok either way; complete, it says so, else it says why it cannot tell.
    complete = missing_rank([_facts(r) for r in range(8)], judged=False)
    assert (complete.status, complete.summary) == (
        "ok",
        "all 8 rank(s) of the world size reported",
    )
    partial = missing_rank(one_of_eight, judged=False)
    assert (partial.status, partial.evidence) == (
        "ok",
        {"judged": False, "world_size": 8, "seen": 1},
    )


def test_whole_job_needs_every_rank_to_say_its_node_holds_the_job() -> None:
    assert whole_job([_facts(0, local_world_size=8), _facts(1, local_world_size=8)])
    assert not whole_job([_facts(0, local_world_size=8), _facts(1, local_world_size=None)])
    assert not whole_job([_facts(0, local_world_size=4)])
    assert not whole_job([])


def test_lost_rank_share_is_of_the_whole_view() -> None:
    t = Thresholds()
    # One node's 4 ranks of 16 lost: 25% is a warning for the job (critical only above it).
    job = [_facts(r, node=f"n{r // 4}", state="lost" if r < 4 else "running") for r in range(16)]
    verdict = lost_rank(job, t)
    assert (verdict.status, verdict.evidence["lost"], verdict.evidence["share"]) == (
        "warning",
        4,
        0.25,
    )
    assert [hit["node"] for hit in verdict.evidence["ranks"]] == ["n0"] * 4
    # The same node alone: all of its ranks lost, critical.
    assert lost_rank(job[:4], t).status == "critical"
    assert lost_rank(job[4:], t).status == "ok"


def test_inf_hotspot_over_window_facts_names_the_rank_and_its_node() -> None:
    t = Thresholds()
    ranks = [
        InfFacts(rank=0, node="n0", local={"cuda:0": 1}, origin={"cuda:0": 1}),
        InfFacts(rank=9, node="n2", local={"cuda:1": 9}, origin={"cuda:1": 9}),
    ]
    verdict = inf_hotspot(ranks, t)
    assert verdict.status == "warning"
    assert verdict.evidence["top"][0] == {
        "rank": 9,
        "node": "n2",
        "device": "cuda:1",
        "detections": 9,
        "share": 0.9,
    }
    assert verdict.summary == "rank 9 device cuda:1 holds 90% of 10 origin found-inf detections"


def test_aligned_desync_compares_ranks_at_the_same_aligned_step_only() -> None:
    def at(rank: int, node: str, step: int, scale: float) -> AlignedFacts:
        return AlignedFacts(rank=rank, node=node, step=step, scale=scale)

    # Rank 4 lags at step 20 with another scale: nothing to compare it with.
    agree = [at(0, "n0", 30, 1024.0), at(1, "n0", 30, 1024.0), at(4, "n2", 20, 64.0)]
    verdict = aligned_scale_desync(agree, scalers=3)
    assert (verdict.status, verdict.evidence["compared_steps"]) == ("ok", 1)
    # Node n1's two ranks differ from the majority at step 30: they are named, with n1.
    split = [*agree, at(2, "n1", 30, 64.0), at(3, "n1", 30, 64.0), at(5, "n2", 30, 1024.0)]
    verdict = aligned_scale_desync(split, scalers=6)
    assert verdict.status == "critical"
    assert verdict.evidence["ranks"] == [
        {"rank": 2, "node": "n1", "scale": 64.0},
        {"rank": 3, "node": "n1", "scale": 64.0},
    ]
    assert (verdict.evidence["newest_mismatched_step"], verdict.evidence["majority_scale"]) == (
        30,
        1024.0,
    )
    assert verdict.summary.endswith("2 of 5 rank(s) differ from the majority's 1024, on node(s) n1")
    assert aligned_scale_desync([], scalers=0).summary == NO_SCALE
