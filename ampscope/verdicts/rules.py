"""Health rules over a neutral view of a run's ranks: what each rank is, where, in which
state and how long since it was heard (``RankFacts``), and what changed within each rule's
window (``ScaleFacts``, ``StepFacts``, ``InfFacts``), not how the exporter stores it.

One implementation of each rule (``scale_collapse``, ``skip_storm``, ``inf_hotspot``,
``lost_rank``, ``missing_rank``; the spike rules live in ``ampscope.verdicts.spikes``)
serves every caller: the exporter's health
(``ampscope.exporter.health``, which builds the facts from its store's snapshots and their
window samples) and ``ampscope status``'s merged view of several exporters (which builds
them from each exporter's ``/ranks`` JSON); a view over Prometheus builds the window facts
from ``max_over_time`` and ``increase``. Only pydantic and the standard library are
imported here, so ``ampscope status`` keeps working without the server extras
(``tests/test_layering.py``).
All functions are pure: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ampscope.exporter.api.models import Verdict
from ampscope.reporter.spike_rule import SpikeRule

RankStateName = Literal["running", "stalled", "lost", "finished", "failed"]

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
    spike_sigmas: float = SpikeRule.sigmas
    """Loss/grad-norm spike (warning): the value stands more than this many standard
    deviations above the mean of the rank's preceding window."""
    spike_window: int = SpikeRule.window
    """Preceding (non-overflow) iterations the spike test compares against."""
    spike_min_window: int = SpikeRule.min_window
    """No spike before this many preceding iterations are known."""
    spike_ratio: float = SpikeRule.ratio
    """A spike is also at least this many times the window's median."""
    spike_verdict_window_s: float = 600.0
    """A spike verdict keeps firing while its newest spike is at most this old."""
    origin_outlier_factor: float = 10.0
    """Origin outlier (warning): a rank's own gradient norm exceeds this many times the
    median of the other ranks' at the same step."""

    def spike_rule(self) -> SpikeRule:
        """The spike rule these thresholds describe."""
        return SpikeRule(
            sigmas=self.spike_sigmas,
            window=self.spike_window,
            min_window=self.spike_min_window,
            ratio=self.spike_ratio,
        )

    def __post_init__(self) -> None:
        self.spike_rule()  # raises ValueError on thresholds the rule refuses
        if not self.spike_verdict_window_s > 0:
            raise ValueError("spike_verdict_window_s must be positive")
        if not self.origin_outlier_factor > 1:
            raise ValueError("origin_outlier_factor must be > 1")
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
        for state in ("finished", "failed", "lost")
        if (count := sum(1 for s in states if s == state))
    ]
    if live == 0:
        return "no live ranks: " + ", ".join(ended) if ended else "no ranks"
    progress = "the live rank is" if live == 1 else f"all {live} live ranks are"
    return f"{progress} making progress" + (f" ({', '.join(ended)})" if ended else "")


@dataclass(frozen=True, kw_only=True)
class ScaleFacts:
    """What ``scale_collapse`` reads of a rank."""

    rank: int
    node: str
    scaler: bool
    """Whether it runs a loss scaler (a watch's scale is no scale)."""
    scale: float
    window_peak_scale: float
    """Its highest scale within the collapse window, the current one included."""


@dataclass(frozen=True, kw_only=True)
class StepFacts:
    """What ``skip_storm`` reads of a rank: its steps and skips within the window."""

    rank: int
    node: str
    steps: int
    skipped: int


@dataclass(frozen=True, kw_only=True)
class InfFacts:
    """What ``inf_hotspot`` reads of a rank: found-inf detections per device within the
    window, local (after the reduction) and at their origin (before it)."""

    rank: int
    node: str
    local: Mapping[str, int]
    origin: Mapping[str, int]


NO_SCALE = "no rank has a loss scale: every rank runs a watch (bf16/fp32)"
"""The summary of the scale rules for a run of watch ranks only."""


def scale_collapse(ranks: Sequence[ScaleFacts], t: Thresholds) -> Verdict:
    """Critical when a rank's scale is below the floor or fell by ``collapse_factor``
    from its peak within the collapse window."""
    thresholds = {
        "scale_floor": t.scale_floor,
        "collapse_factor": t.collapse_factor,
        "window_s": t.collapse_window_s,
    }
    hits: list[dict[str, Any]] = []
    lowest = None
    scalers = [facts for facts in ranks if facts.scaler]
    for facts in scalers:
        scale, peak = facts.scale, facts.window_peak_scale
        fall = peak / scale if scale > 0 else float("inf")
        lowest = scale if lowest is None else min(lowest, scale)
        reasons = []
        if scale < t.scale_floor:
            reasons.append("below_floor")
        if fall >= t.collapse_factor:
            reasons.append("fell")
        if reasons:
            hits.append(
                {
                    "rank": facts.rank,
                    "node": facts.node,
                    "scale": scale,
                    "window_peak_scale": peak,
                    "fall_factor": fall if scale > 0 else None,
                    "reasons": reasons,
                }
            )
    if not hits:
        return Verdict(
            rule="scale_collapse",
            status="ok",
            summary="no rank's loss scale collapsed" if scalers or not ranks else NO_SCALE,
            evidence={"lowest_scale": lowest},
            thresholds=thresholds,
        )
    worst = min(hits, key=lambda h: h["scale"])
    return Verdict(
        rule="scale_collapse",
        status="critical",
        summary=f"loss scale collapsed on {len(hits)} rank(s): rank {worst['rank']} is at "
        f"{worst['scale']:g} (window peak {worst['window_peak_scale']:g})",
        evidence={"ranks_affected": len(hits), "ranks": hits[:MAX_EVIDENCE_RANKS]},
        thresholds=thresholds,
    )


def skip_storm(ranks: Sequence[StepFacts], t: Thresholds) -> Verdict:
    """Warning when a rank skipped more than ``skip_storm_ratio`` of its window's steps."""
    thresholds = {
        "ratio": t.skip_storm_ratio,
        "window_s": t.skip_storm_window_s,
        "min_steps": t.skip_storm_min_steps,
    }
    hits: list[dict[str, Any]] = []
    worst_ratio = 0.0
    for facts in ranks:
        steps, skipped = facts.steps, facts.skipped
        if steps < t.skip_storm_min_steps:
            continue
        ratio = skipped / steps
        worst_ratio = max(worst_ratio, ratio)
        if ratio > t.skip_storm_ratio:
            who = {"rank": facts.rank, "node": facts.node}
            hits.append({**who, "steps": steps, "skipped": skipped, "ratio": ratio})
    if not hits:
        return Verdict(
            rule="skip_storm",
            status="ok",
            summary="skipped steps within bounds",
            evidence={"worst_ratio": worst_ratio},
            thresholds=thresholds,
        )
    worst = max(hits, key=lambda h: h["ratio"])
    return Verdict(
        rule="skip_storm",
        status="warning",
        summary=f"{worst['skipped']} of rank {worst['rank']}'s last {worst['steps']} steps "
        f"were skipped ({worst['ratio']:.0%}) on {len(hits)} rank(s)",
        evidence={"ranks_affected": len(hits), "ranks": hits[:MAX_EVIDENCE_RANKS]},
        thresholds=thresholds,
    )


def inf_hotspot(ranks: Sequence[InfFacts], t: Thresholds) -> Verdict:
    """Warning when one rank/device holds ``hotspot_share`` of the window's detections.

    Counts origin detections (pre-reduction gradients) when any rank tracks origin in
    the window, else local found-inf. Needs at least two rank/device series: a single
    device is trivially 100% of its own detections.
    """
    thresholds = {
        "share": t.hotspot_share,
        "window_s": t.hotspot_window_s,
        "min_detections": t.hotspot_min_detections,
    }
    origin = [(facts, device, n) for facts in ranks for device, n in facts.origin.items()]
    local = [(facts, device, n) for facts in ranks for device, n in facts.local.items()]
    source, series = ("origin", origin) if sum(n for *_, n in origin) > 0 else ("local", local)
    total = sum(n for *_, n in series)
    evidence: dict[str, Any] = {"source": source, "detections": total, "series": len(series)}
    if total == 0 or len(series) < 2:
        return Verdict(
            rule="inf_hotspot",
            status="ok",
            summary="no rank/device dominates the found-inf detections",
            evidence=evidence,
            thresholds=thresholds,
        )
    ordered = sorted(series, key=lambda item: -item[2])
    top: list[dict[str, Any]] = [
        {"rank": s.rank, "node": s.node, "device": d, "detections": n, "share": n / total}
        for s, d, n in ordered[:5]
        if n > 0
    ]
    evidence["top"] = top
    lead = top[0]
    if total >= t.hotspot_min_detections and lead["share"] >= t.hotspot_share:
        return Verdict(
            rule="inf_hotspot",
            status="warning",
            summary=f"rank {lead['rank']} device {lead['device']} holds {lead['share']:.0%} "
            f"of {total} {source} found-inf detections",
            evidence=evidence,
            thresholds=thresholds,
        )
    return Verdict(
        rule="inf_hotspot",
        status="ok",
        summary="no rank/device dominates the found-inf detections",
        evidence=evidence,
        thresholds=thresholds,
    )


@dataclass(frozen=True, kw_only=True)
class AlignedFacts:
    """What ``aligned_scale_desync`` reads of a scaler rank: its scale after its newest
    step that is a multiple of ``SCALE_ALIGN_STEPS`` (``ampscope_loss_scale_aligned``)."""

    rank: int
    node: str
    step: int
    scale: float


def aligned_scale_desync(ranks: Sequence[AlignedFacts], scalers: int) -> Verdict:
    """Critical when ranks at the same aligned step hold different scales: the desync check
    that needs no per-step history, so it also compares ranks across nodes (a merged view
    of several exporters, or Prometheus). Ranks at different aligned steps (some lag) are
    not compared. O(ranks).

    Args:
        ranks: the scaler ranks that reported an aligned scale.
        scalers: how many ranks run a scaler at all (0: the run has no loss scale).
    """
    by_step: dict[int, list[AlignedFacts]] = {}
    for facts in ranks:
        by_step.setdefault(facts.step, []).append(facts)
    compared = sorted(step for step, group in by_step.items() if len(group) > 1)
    mismatched = [step for step in compared if len({f.scale for f in by_step[step]}) > 1]
    thresholds: dict[str, float | int] = {}
    if not mismatched:
        return Verdict(
            rule="scale_desync",
            status="ok",
            summary=f"ranks agree on the scale at {len(compared)} shared aligned step(s)"
            if scalers
            else NO_SCALE,
            evidence={"compared_steps": len(compared), "source": "aligned"},
            thresholds=thresholds,
        )
    step = mismatched[-1]
    group = sorted(by_step[step], key=lambda f: f.rank)
    counts: dict[float, int] = {}
    for facts in group:
        counts[facts.scale] = counts.get(facts.scale, 0) + 1
    majority = max(counts, key=lambda scale: counts[scale])
    odd = [f for f in group if f.scale != majority]
    nodes = sorted({f.node for f in odd})
    return Verdict(
        rule="scale_desync",
        status="critical",
        summary=f"ranks disagree on the loss scale at aligned step {step}: {len(odd)} of "
        f"{len(group)} rank(s) differ from the majority's {majority:g}, on node(s) "
        + ", ".join(nodes[:MAX_EVIDENCE_RANKS]),
        evidence={
            "source": "aligned",
            "compared_steps": len(compared),
            "mismatched_steps": len(mismatched),
            "newest_mismatched_step": step,
            "ranks_at_newest": len(group),
            "majority_scale": majority,
            "ranks": [
                {"rank": f.rank, "node": f.node, "scale": f.scale} for f in odd[:MAX_EVIDENCE_RANKS]
            ],
        },
        thresholds=thresholds,
    )


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
