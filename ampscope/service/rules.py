"""Health rules over a neutral view of a run's ranks: what each rank is, where, in which
state and how long since it was heard (``RankFacts``), not how the exporter stores it.

One implementation of each rule serves two callers: the exporter's health
(``ampscope.service.health``, which builds the facts from its store's snapshots) and
``ampscope status``'s merged view of several exporters (which builds them from each
exporter's ``/ranks`` JSON). Only pydantic and the standard library are imported here, so
``ampscope status`` keeps working without the server extras (``tests/test_layering.py``).
All functions are pure: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ampscope.service.models import Verdict

RankStateName = Literal["running", "stalled", "lost", "finished"]

MAX_EVIDENCE_RANKS = 16
"""Ranks listed in one verdict's evidence at most (the count is always given)."""


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Health-rule thresholds; the defaults are the ones the Prometheus alert rules use."""

    scale_floor: float = 1.0
    """Scale collapse (critical): scale below this."""
    collapse_factor: float = 2.0**8
    """Scale collapse (critical): the window's peak scale / current scale at least this."""
    collapse_window_s: float = 600.0
    skip_storm_ratio: float = 0.25
    """Skip storm (warning): skipped / steps over the window above this."""
    skip_storm_window_s: float = 300.0
    skip_storm_min_steps: int = 10
    """Skip storm: fewer steps in the window say nothing."""
    stale_after_s: float = 60.0
    """Lost rank (warning): nothing heard for this long, and no final record."""
    stall_after_s: float = 600.0
    """Stalled rank (warning): heard from, but no new step for this long."""
    lost_critical_share: float = 0.25
    """Lost rank turns critical when more than this share of the run's ranks are lost."""
    hotspot_share: float = 0.8
    """Inf hotspot (warning): one rank/device holds at least this share of detections."""
    hotspot_window_s: float = 600.0
    hotspot_min_detections: int = 5

    def __post_init__(self) -> None:
        for name in ("collapse_window_s", "skip_storm_window_s", "stale_after_s", "stall_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not self.hotspot_window_s > 0:
            raise ValueError("hotspot_window_s must be positive")
        if self.scale_floor < 0:
            raise ValueError("scale_floor must be >= 0")
        if not self.collapse_factor > 1:
            raise ValueError("collapse_factor must be > 1")
        if not 0 <= self.skip_storm_ratio <= 1:
            raise ValueError("skip_storm_ratio must be within [0, 1]")
        if not 0 < self.hotspot_share <= 1:
            raise ValueError("hotspot_share must be within (0, 1]")
        if self.skip_storm_min_steps < 1 or self.hotspot_min_detections < 1:
            raise ValueError("minimum counts must be at least 1")


@dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What the liveness and coverage rules read of one rank."""

    rank: int
    node: str
    state: RankStateName
    world_size: int
    """The world size the rank declared."""
    local_world_size: int | None
    """Ranks on its node, when the rank said (torchrun's ``LOCAL_WORLD_SIZE``)."""
    last_step: int
    last_report_time: float
    """When it was last heard from (the exporter's clock)."""
    seconds_since_report: float


def progress_summary(live: int, states: Sequence[RankStateName]) -> str:
    """What an ok ``stalled_rank`` says: the live ranks making progress, and how many of
    the others finished or were lost ("no live ranks: 4 finished" once all finished)."""
    ended = [
        f"{count} {state}"
        for state in ("finished", "lost")
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
    if not ranks:
        return Verdict(
            rule="missing_rank",
            status="ok",
            summary="no ranks",
            evidence={"missing": 0},
            thresholds={},
        )
    world_size = declared_world_size(ranks)
    missing = missing_ranks(ranks)
    seen = len({facts.rank for facts in ranks if facts.rank < world_size})
    if not missing:
        return Verdict(
            rule="missing_rank",
            status="ok",
            summary=f"all {world_size} rank(s) of the world size reported",
            evidence={"judged": True, "world_size": world_size, "seen": seen, "missing": 0},
            thresholds={},
        )
    if not judged:
        return Verdict(
            rule="missing_rank",
            status="ok",
            summary=f"not judged: {seen} of {world_size} rank(s) report here, and this "
            "exporter sees one node; `ampscope status --url` over every node's exporter names "
            "the ranks that never reported",
            evidence={"judged": False, "world_size": world_size, "seen": seen},
            thresholds={},
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
    return Verdict(
        rule="missing_rank",
        status="warning",
        summary=f"{len(missing)} of {world_size} rank(s) never reported (their reporter off, "
        f"or their exporter not asked): rank(s) {shown}{more}",
        evidence=evidence,
        thresholds={},
    )


def lost_rank(ranks: Sequence[RankFacts], t: Thresholds) -> Verdict:
    """Warning when a rank went silent for ``stale_after_s`` without its final record;
    critical when more than ``lost_critical_share`` of the run's ranks did."""
    thresholds = {"stale_after_s": t.stale_after_s, "critical_share": t.lost_critical_share}
    lost = [
        {
            "rank": facts.rank,
            "node": facts.node,
            "seconds_since_report": facts.seconds_since_report,
            "last_step": facts.last_step,
        }
        for facts in ranks
        if facts.state == "lost"
    ]
    if not lost:
        return Verdict(
            rule="lost_rank",
            status="ok",
            summary=f"no rank of {len(ranks)} lost",
            evidence={"lost": 0},
            thresholds=thresholds,
        )
    share = len(lost) / len(ranks)
    return Verdict(
        rule="lost_rank",
        status="critical" if share > t.lost_critical_share else "warning",
        summary=f"{len(lost)} of {len(ranks)} rank(s) went silent without finishing (process "
        f"died or network broken): rank {lost[0]['rank']} last heard "
        f"{lost[0]['seconds_since_report']:.0f} s ago at step {lost[0]['last_step']}",
        evidence={"lost": len(lost), "share": share, "ranks": lost[:MAX_EVIDENCE_RANKS]},
        thresholds=thresholds,
    )
