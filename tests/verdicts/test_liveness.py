"""The liveness and coverage rules over ``RankFacts``, as any view calls them (the exporter's
path over its store is in tests/exporter/test_health.py and state/test_lifecycle.py)."""

from __future__ import annotations

import pytest

from ampscope.verdicts.liveness import (
    declared_world_size,
    lost_rank,
    missing_rank,
    missing_ranks,
    progress_summary,
    stalled_rank,
    stopped_alone,
    stopped_rank,
    whole_job,
)
from ampscope.verdicts.ranks import RankFacts, RankPaused, paused_of
from ampscope.verdicts.thresholds import Thresholds


def _facts(
    rank: int,
    *,
    node: str = "n0",
    state: str = "running",
    world_size: int = 8,
    local_world_size: int | None = 4,
    heard: float = 100.0,
    step_time: float | None = None,
    pause: RankPaused | None = None,
    now: float = 200.0,
) -> RankFacts:
    return RankFacts(
        rank=rank,
        node=node,
        state=state,
        world_size=world_size,
        local_world_size=local_world_size,
        last_step=10 + rank,
        last_report_time=heard,
        seconds_since_report=now - heard,
        step_time=step_time,
        pause=pause,
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


def test_stopped_ranks_are_never_lost_nor_counted_in_the_lost_share() -> None:
    t = Thresholds()
    # Every rank stopped by its launcher (torchrun's restart, a preemption): nothing lost.
    stopped = [_facts(r, state="stopped", heard=10.0) for r in range(4)]
    verdict = lost_rank(stopped, t)
    assert (verdict.status, verdict.evidence) == ("ok", {"lost": 0})
    # An elastic restart shrank 8 ranks to 4: ranks 4..7 of the old generation linger
    # stopped. Two of the 4 ranks of the job now go silent: half of the job, critical,
    # not 2 of 8 (a quarter: a warning) as if the stopped ranks were still in it.
    shrunk = [
        _facts(r, state="lost" if r in (2, 3) else "running", world_size=4) for r in range(4)
    ] + [_facts(r, state="stopped", heard=10.0) for r in range(4, 8)]
    verdict = lost_rank(shrunk, t)
    assert (verdict.status, verdict.evidence["lost"], verdict.evidence["share"]) == (
        "critical",
        2,
        0.5,
    )
    assert verdict.summary.startswith("2 of 4 rank(s) went silent without finishing")
    # One rank SIGKILLed (the OOM killer), the others stopped by the agent: that one is lost.
    killed = [_facts(0, state="lost"), *stopped[1:]]
    assert lost_rank(killed, t).evidence["lost"] == 1


def test_a_stopped_rank_is_neither_live_nor_missing() -> None:
    t = Thresholds()
    ranks = [_facts(0), _facts(1, state="stopped")]
    verdict = stalled_rank(ranks, t)
    assert (verdict.status, verdict.evidence["live"]) == ("ok", 1)
    assert verdict.summary == "the live rank is making progress (1 stopped)"
    everyone = [_facts(r, state="stopped", world_size=2, local_world_size=2) for r in (0, 1)]
    assert stalled_rank(everyone, t).summary == "no live ranks: 2 stopped"
    assert missing_rank(everyone, judged=True).status == "ok"  # they reported: not missing


def test_stalled_rank_names_the_culprit_only_when_every_live_rank_stalled() -> None:
    t = Thresholds()
    # Ranks 0..3 on two nodes stalled at steps 10..13: the lowest step stopped first; at
    # equal steps, the rank whose step came first on its own clock.
    hang = [_facts(r, node=f"n{r // 2}", state="stalled", step_time=50.0 - r) for r in range(4)]
    verdict = stalled_rank(hang, t)
    assert verdict.status == "warning"
    assert verdict.evidence["culprit"] == {
        "rank": 0,
        "node": "n0",
        "last_step": 10,
        "step_time": 50.0,
        "seconds_since_progress": None,
    }
    assert "every live rank stalled (a hang?): rank 0 (node n0) stopped first" in verdict.summary
    tie = [_facts(0, state="stalled", step_time=9.0), _facts(0, state="stalled", step_time=8.0)]
    assert stalled_rank(tie, t).evidence["culprit"]["step_time"] == 8.0
    # One stalled among running ones: named, but no culprit; a finished one is not live.
    some = [*hang[:1], _facts(4, node="n2"), _facts(5, node="n2", state="finished")]
    verdict = stalled_rank(some, t)
    assert (verdict.status, verdict.evidence["stalled"], verdict.evidence["live"]) == (
        "warning",
        1,
        2,
    )
    assert "culprit" not in verdict.evidence
    assert verdict.summary == "1 of 2 live rank(s) still report but took no step for over 600 s"
    quiet = stalled_rank(some[1:], t)
    assert (quiet.status, quiet.summary) == ("ok", "the live rank is making progress (1 finished)")
    assert quiet.thresholds == {"stall_after_s": 600.0, "pause_limit_s": 7200.0}


@pytest.mark.parametrize(
    ("live", "states", "summary"),
    [
        (0, ["finished"] * 4, "no live ranks: 4 finished"),
        (0, ["finished", "finished", "finished", "lost"], "no live ranks: 3 finished, 1 lost"),
        (0, ["lost", "lost"], "no live ranks: 2 lost"),
        (0, [], "no ranks"),
        (1, ["running"], "the live rank is making progress"),
        (3, ["running"] * 3 + ["finished"], "all 3 live ranks are making progress (1 finished)"),
        (2, ["running", "running", "lost", "finished"], "all 2 live ranks are making progress"
         " (1 finished, 1 lost)"),
    ],
)  # fmt: skip
def test_progress_summary_says_what_is_true(live: int, states: list, summary: str) -> None:
    assert progress_summary(live, states) == summary


def test_paused_ranks_are_named_in_an_ok_verdict_and_past_their_limit_in_a_warning() -> None:
    t = Thresholds()
    saving = [_facts(r, pause=RankPaused(reason="checkpoint", seconds=700.0 + r)) for r in range(3)]
    verdict = stalled_rank([*saving, _facts(3)], t)
    assert verdict.status == "ok"
    assert verdict.summary == (
        "3 of 4 live rank(s) paused on purpose, within pause_limit_s 7200 s: rank 2 (node n0) "
        "paused (checkpoint) for 702 s"
    )
    assert verdict.evidence["paused"] == 3
    # Stalled while paused (the exporter's pause_limit_s passed): still a hang.
    over = [
        _facts(r, state="stalled", pause=RankPaused(reason="checkpoint", seconds=7300.0))
        for r in range(2)
    ]
    verdict = stalled_rank(over, t)
    assert verdict.status == "warning"
    assert (
        "(2 of them paused past pause_limit_s 7200 s: rank 0 paused (checkpoint) for 7300 s)"
        in (verdict.summary)
    )
    assert "every live rank stalled (a hang?)" in verdict.summary


def test_a_pause_read_from_an_exporters_json() -> None:
    assert paused_of({"pause": {"reason": "eval", "seconds": 12}}) == RankPaused(
        reason="eval", seconds=12.0
    )
    # None, an older exporter (no field) or a malformed one: no pause.
    for view in ({"pause": None}, {}, {"pause": {"reason": 3, "seconds": 1.0}}):
        assert paused_of(view) is None


T = Thresholds()
NOW = 1000.0
"""The view's time in the stopped-rank tests: a stop at 600 s is 400 s old, past the
default grace of 300 s."""


def _job(states: dict[int, str], *, world_size: int = 8, stopped_at: float = 600.0) -> list:
    """Ranks of a two-node job (four per node): live ones heard just now, stopped ones last
    heard at their goodbye."""
    return [
        _facts(
            rank,
            node=f"n{rank // 4}",
            state=state,
            world_size=world_size,
            heard=stopped_at if state == "stopped" else NOW - 1,
            now=NOW,
        )
        for rank, state in states.items()
    ]


def test_a_rank_evicted_while_its_world_runs_is_a_warning_after_the_grace() -> None:
    # Kubernetes evicts the single-GPU pod of rank 5 of a non-elastic job; the others go on.
    ranks = _job({r: "stopped" if r == 5 else "running" for r in range(8)})
    verdict = stopped_rank(ranks, T, judged=True)
    assert verdict.status == "warning"
    assert verdict.evidence == {
        "judged": True,
        "stopped": 1,
        "alone": 1,
        "share": 1 / 8,
        "world_size": 8,
        "ranks": [{"rank": 5, "node": "n1", "seconds_since_stop": 400.0, "last_step": 15}],
    }
    assert "rank 5 (node n1) stopped 400 s ago at step 15" in verdict.summary
    assert verdict.thresholds == {"grace_s": 300.0, "critical_share": 0.25}
    # Within the grace an elastic restart may still bring it back: ok.
    assert stopped_rank(_job({0: "running", 5: "stopped"}, stopped_at=NOW - 300), T,
                        judged=True).status == "ok"  # fmt: skip


def test_the_peers_that_hang_after_the_eviction_still_count_as_live() -> None:
    # The rest of the job hangs in its next collective: stalled, still heard, still live.
    hung = _job({r: "stopped" if r >= 4 else "stalled" for r in range(8)})
    verdict = stopped_rank(hung, T, judged=True)
    assert verdict.status == "critical"  # a whole node of 8: more than a quarter
    assert [r["rank"] for r in verdict.evidence["ranks"]] == [4, 5, 6, 7]


def test_a_restart_whose_ids_came_back_is_silent() -> None:
    # Every id came back (the merged view holds each rank's newest copy: running).
    assert stopped_rank(_job(dict.fromkeys(range(8), "running")), T, judged=True).status == "ok"
    # A view that still holds an old copy whose id a live rank holds on another node.
    moved = [*_job(dict.fromkeys(range(8), "running")), _facts(3, node="n9", state="stopped",
             heard=600.0, now=NOW)]  # fmt: skip
    assert stopped_alone(moved, T) == []


def test_an_elastic_shrink_leaves_its_old_ids_stopped_in_silence() -> None:
    # torchrun restarts 8 ranks as 7: ranks 0..6 declare 7, old rank 7 stays stopped (8).
    shrunk = [*_job(dict.fromkeys(range(7), "running"), world_size=7),
              *_job({7: "stopped"}, world_size=8)]  # fmt: skip
    verdict = stopped_rank(shrunk, T, judged=True)
    assert verdict.status == "ok"
    assert verdict.summary == (
        "1 stopped rank(s), none stopped alone while its world goes on for over 300 s"
    )
    # An eviction in the shrunk world is one.
    evicted = [*shrunk[:6], *_job({6: "stopped"}, world_size=7), shrunk[7]]
    assert [f.rank for f in stopped_alone(evicted, T)] == [6]


def test_a_whole_job_stop_leaves_no_live_rank_and_is_silent() -> None:
    # Slurm preempts the job (or it finished, or some ranks were lost): nothing goes on.
    for others in ("stopped", "finished", "lost", "failed"):
        ranks = _job({r: "stopped" if r < 4 else others for r in range(8)})
        assert stopped_rank(ranks, T, judged=True).status == "ok", others
    assert stopped_rank([], T, judged=True).summary == "no rank stopped"


def test_one_node_alone_does_not_judge_a_stop_it_cannot_tell_from_a_renumbering() -> None:
    # After an elastic restart the new generation may number this node's ranks anew: its
    # exporter holds the old ids stopped and new ids running, the old ids back elsewhere.
    node = _job({r: "stopped" if r < 4 else "running" for r in range(8)})
    verdict = stopped_rank(node, T, judged=False)
    assert verdict.status == "ok"
    assert verdict.evidence == {"judged": False, "stopped": 4, "alone": 4}
    assert verdict.summary.startswith("not judged: 4 rank(s) here stopped over 300 s ago")


def test_the_grace_is_a_positive_threshold() -> None:
    assert stopped_alone(_job({0: "running", 5: "stopped"}), Thresholds(stopped_grace_s=500)) == []
    with pytest.raises(ValueError, match="stopped_grace_s"):
        Thresholds(stopped_grace_s=0)
