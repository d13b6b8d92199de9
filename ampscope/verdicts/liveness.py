"""The liveness and coverage rules: ``lost_rank`` (silent without finishing),
``missing_rank`` (never reported), ``stalled_rank`` (heard from, no new step, or none for
``pause_limit_s`` when it paused on purpose) and ``stopped_rank`` (stopped by its launcher
while its world goes on), over ``RankFacts``.

A view of one node's exporter and a view of the whole job (a merge of every node's
exporter, or Prometheus) call the same rules; the whole job's view is what makes a lost
share or a missing rank the job's.

Pure functions: O(ranks), or O(world size) for the missing ranks; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ampscope.verdicts.ranks import ENDED_STATES, LIVE_STATES, RankFacts
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, rule_verdicts


def progress_summary(live: int, states: Sequence[str]) -> str:
    """What an ok ``stalled_rank`` says: the live ranks making progress, and how many of
    the others finished or were lost ("no live ranks: 4 finished" once all finished)."""
    ended = [
        f"{count} {state}"
        for state in ENDED_STATES
        if (count := sum(1 for s in states if s == state))
    ]
    if live == 0:
        return "no live ranks: " + ", ".join(ended) if ended else "no ranks"
    progress = "the live rank is" if live == 1 else f"all {live} live ranks are"
    return f"{progress} making progress" + (f" ({', '.join(ended)})" if ended else "")


def declared_world_size(ranks: Sequence[RankFacts]) -> int:
    """The run's world size: the one its most recently heard rank declared (after an
    elastic resize, ranks of the old size may linger until retention drops them)."""
    newest = max(ranks, key=lambda facts: (facts.last_report_time, facts.rank))
    return newest.world_size


def whole_job(ranks: Sequence[RankFacts]) -> bool:
    """Whether ``ranks`` can be the whole job as one exporter sees it: every rank says its
    node holds all of the job's ranks (``local_world_size == world_size``). A node's exporter
    of a multi-node job sees only its node, so it cannot tell a missing rank from one that
    reports to another node's exporter."""
    return bool(ranks) and all(
        facts.local_world_size is not None and facts.local_world_size == facts.world_size
        for facts in ranks
    )


def missing_ranks(ranks: Sequence[RankFacts]) -> list[int]:
    """Ranks below the declared world size that never reported, ascending: O(world size)."""
    if not ranks:
        return []
    seen = {facts.rank for facts in ranks}
    return [rank for rank in range(declared_world_size(ranks)) if rank not in seen]


def missing_rank(ranks: Sequence[RankFacts], *, judged: bool) -> Verdict:
    """Warning when ranks that the world size says exist never reported; never critical on
    its own, as a rank's reporter may simply be off (``AMPSCOPE_URL=off``, no exporter).

    Args:
        ranks: every rank held of the run.
        judged: whether ``ranks`` is the whole job (a merged view of every node, or
            :func:`whole_job`); when not and ranks are unseen, the verdict is ok and says
            why it cannot judge.
    """
    say = rule_verdicts("missing_rank")
    if not ranks:
        return say("ok", "no ranks", {"missing": 0})
    world_size = declared_world_size(ranks)
    missing = missing_ranks(ranks)
    seen = len({facts.rank for facts in ranks if facts.rank < world_size})
    if not missing:
        return say(
            "ok",
            f"all {world_size} rank(s) of the world size reported",
            {"judged": True, "world_size": world_size, "seen": seen, "missing": 0},
        )
    if not judged:
        return say(
            "ok",
            f"not judged: {seen} of {world_size} rank(s) report here, and this "
            "exporter sees one node; `ampscope status --url` over every node's exporter names "
            "the ranks that never reported",
            {"judged": False, "world_size": world_size, "seen": seen},
        )
    evidence = {
        "judged": True,
        "world_size": world_size,
        "seen": seen,
        "missing": len(missing),
        "ranks": missing[:MAX_EVIDENCE_RANKS],
    }
    shown = ", ".join(map(str, missing[:MAX_EVIDENCE_RANKS]))
    hidden = len(missing) - MAX_EVIDENCE_RANKS
    more = f" and {hidden} more" if hidden > 0 else ""
    return say(
        "warning",
        f"{len(missing)} of {world_size} rank(s) never reported (their reporter off, "
        f"or their exporter not asked): rank(s) {shown}{more}",
        evidence,
    )


def lost_rank(ranks: Sequence[RankFacts], t: Thresholds) -> Verdict:
    """Warning when a rank went silent for ``stale_after_s`` without its final record;
    critical when more than ``lost_critical_share`` of the run's ranks did.

    A ``stopped`` rank said goodbye (its launcher stopped it with a signal) and is never
    lost; nor does it count in the share: after an elastic restart that shrank or
    renumbered the world, the old generation's ranks linger ``stopped`` until retention
    drops them, and must not dilute the share of the ranks that make up the job now.
    """
    say = rule_verdicts("lost_rank", t)
    lost = [
        {
            **facts.ref(),
            "seconds_since_report": facts.seconds_since_report,
            "last_step": facts.last_step,
        }
        for facts in ranks
        if facts.state == "lost"
    ]
    if not lost:
        return say("ok", f"no rank of {len(ranks)} lost", {"lost": 0})
    counted = sum(1 for facts in ranks if facts.state != "stopped")
    share = len(lost) / counted
    return say(
        "critical" if share > t.lost_critical_share else "warning",
        f"{len(lost)} of {counted} rank(s) went silent without finishing (process "
        f"died or network broken): rank {lost[0]['rank']} last heard "
        f"{lost[0]['seconds_since_report']:.0f} s ago at step {lost[0]['last_step']}",
        {"lost": len(lost), "share": share, "ranks": lost[:MAX_EVIDENCE_RANKS]},
    )


def paused_summary(live: int, paused: Sequence[RankFacts], t: Thresholds) -> str:
    """What an ok ``stalled_rank`` says of live ranks that paused on purpose: "rank 0
    (node a) paused (checkpoint) for 700 s, 1 of 1 live rank(s) paused within
    pause_limit_s 7200 s", the longest pause first."""
    first = max(paused, key=lambda facts: facts.pause.seconds if facts.pause else 0.0)
    assert first.pause is not None
    return (
        f"{len(paused)} of {live} live rank(s) paused on purpose, within pause_limit_s "
        f"{max(t.pause_limit_s, t.stall_after_s):g} s: rank {first.rank} (node {first.node}) "
        f"{first.pause.text()}"
    )


def stopped_alone(ranks: Sequence[RankFacts], t: Thresholds) -> list[RankFacts]:
    """The ``stopped`` ranks whose stop lasts while the rest of their world goes on, by rank.

    A launcher's restart (torchrun's elastic agent) stops every rank and starts a new
    generation that brings each id back within moments; a whole-job stop (a preemption, a
    time limit) leaves no live rank. A rank counts when all of these hold:

    - its goodbye (its last report) is over ``stopped_grace_s`` old;
    - no live (running or stalled) rank holds its id (in a view of several exporters, the
      id may have come back on another node);
    - a live rank of the run declared the same world size: the rank belongs to the world
      that still runs. After an elastic shrink (8 to 7) the old generation's ids from 7 up
      stay stopped with the old size until retention drops them, and say nothing; within a
      world its ids are below its size, so this is "its id is below the live world size"
      where that can be told (PromQL cannot compare the ``rank`` label with ``world_size``
      as numbers, but can match the labels).

    O(ranks).
    """
    live = [facts for facts in ranks if facts.state in LIVE_STATES]
    live_ids = {facts.rank for facts in live}
    live_worlds = {facts.world_size for facts in live}
    return sorted(
        (
            facts
            for facts in ranks
            if facts.state == "stopped"
            and facts.seconds_since_report > t.stopped_grace_s
            and facts.rank not in live_ids
            and facts.world_size in live_worlds
        ),
        key=lambda facts: facts.rank,
    )


def stopped_rank(ranks: Sequence[RankFacts], t: Thresholds, *, judged: bool) -> Verdict:
    """Warning when a rank its launcher stopped (SIGTERM) stays ``stopped`` while the rest of
    its world goes on (``stopped_alone``): one pod of a non-elastic job evicted, one worker
    stopped by a supervisor. Its peers hang in their next collective, which ``stalled_rank``
    would say only after ``stall_after_s``. Critical when more than ``lost_critical_share``
    of the world stopped so, as ``lost_rank`` does for lost ranks.

    Args:
        ranks: every rank held of the run.
        judged: whether ``ranks`` is the whole job (a merged view of every node, or
            :func:`whole_job`). One node's exporter cannot tell a stop that lasts from a
            restart whose new generation numbered this node's ranks anew and brought the old
            ids back on other nodes: when not judged and ranks stopped alone here, the
            verdict is ok and says why.
    """
    say = rule_verdicts("stopped_rank", t)
    stopped = sum(1 for facts in ranks if facts.state == "stopped")
    alone = stopped_alone(ranks, t)
    if not alone:
        summary = (
            f"{stopped} stopped rank(s), none stopped alone while its world goes on for over "
            f"{t.stopped_grace_s:g} s"
            if stopped
            else "no rank stopped"
        )
        return say("ok", summary, {"stopped": stopped, "alone": 0})
    if not judged:
        return say(
            "ok",
            f"not judged: {len(alone)} rank(s) here stopped over {t.stopped_grace_s:g} s ago "
            "while ranks of their world run, and this exporter sees one node (a restart may "
            "have brought their ids back on others); `ampscope status --url` over every "
            "node's exporter judges",
            {"judged": False, "stopped": stopped, "alone": len(alone)},
        )
    world_size = max(facts.world_size for facts in alone)
    share = len(alone) / world_size
    listed = [
        {
            **facts.ref(),
            "seconds_since_stop": facts.seconds_since_report,
            "last_step": facts.last_step,
        }
        for facts in alone
    ]
    first = listed[0]
    return say(
        "critical" if share > t.lost_critical_share else "warning",
        f"{len(alone)} of {world_size} rank(s) were stopped by their launcher (SIGTERM) and "
        f"stay stopped while the rest of their world goes on (an eviction or preemption of "
        f"part of the job; a restart would have brought them back): rank {first['rank']} "
        f"(node {first['node']}) stopped {first['seconds_since_stop']:.0f} s ago at step "
        f"{first['last_step']}",
        {
            "judged": True,
            "stopped": stopped,
            "alone": len(alone),
            "share": share,
            "world_size": world_size,
            "ranks": listed[:MAX_EVIDENCE_RANKS],
        },
    )


def stalled_rank(ranks: Sequence[RankFacts], t: Thresholds) -> Verdict:
    """Warning when a rank is still heard from but took no new step for ``stall_after_s``
    (its state is ``stalled``); for a rank that says it paused on purpose (``paused()``),
    for ``pause_limit_s``. Ranks paused within their limit are running: the ok verdict
    names them ("paused (checkpoint) for 700 s").

    When every live (running or stalled) rank stalled, the run hangs: the rank whose last
    step is lowest, or at equal steps whose last step is oldest on its own clock, is named
    as the likely culprit (the others typically wait for it in a collective).
    """
    say = rule_verdicts("stalled_rank", t)
    states = [facts.state for facts in ranks]
    stalled = [facts for facts in ranks if facts.state == "stalled"]
    live = sum(1 for state in states if state in LIVE_STATES)
    paused = [facts for facts in ranks if facts.state == "running" and facts.pause is not None]
    if not stalled:
        evidence: dict[str, Any] = {"stalled": 0, "live": live}
        if not paused:
            return say("ok", progress_summary(live, states), evidence)
        evidence["paused"] = len(paused)
        evidence["paused_ranks"] = [_paused_ref(facts) for facts in paused[:MAX_EVIDENCE_RANKS]]
        return say("ok", paused_summary(live, paused, t), evidence)
    listed = [
        {
            **facts.ref(),
            "last_step": facts.last_step,
            "step_time": facts.step_time,
            "seconds_since_progress": facts.seconds_since_progress,
            **({} if facts.pause is None else {"pause": _pause_of(facts)}),
        }
        for facts in sorted(stalled, key=lambda facts: (facts.last_step, facts.step_time or 0.0))
    ]
    evidence = {
        "stalled": len(stalled),
        "live": live,
        "ranks": listed[:MAX_EVIDENCE_RANKS],
    }
    summary = (
        f"{len(stalled)} of {live} live rank(s) still report but took no step for over "
        f"{t.stall_after_s:g} s"
    )
    over_pause = [facts for facts in stalled if facts.pause is not None]
    if over_pause:
        first = over_pause[0]
        assert first.pause is not None
        summary += (
            f" ({len(over_pause)} of them paused past pause_limit_s "
            f"{max(t.pause_limit_s, t.stall_after_s):g} s: rank {first.rank} "
            f"{first.pause.text()})"
        )
    if len(stalled) == live:
        culprit = listed[0]
        evidence["culprit"] = culprit
        summary += (
            f"; every live rank stalled (a hang?): rank {culprit['rank']} (node "
            f"{culprit['node']}) stopped first, at step {culprit['last_step']}: the likely "
            "culprit"
        )
    return say("warning", summary, evidence)


def _pause_of(facts: RankFacts) -> dict[str, Any]:
    assert facts.pause is not None
    return {"reason": facts.pause.reason, "seconds": facts.pause.seconds}


def _paused_ref(facts: RankFacts) -> dict[str, Any]:
    return {**facts.ref(), "last_step": facts.last_step, "pause": _pause_of(facts)}
