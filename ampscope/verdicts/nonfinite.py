"""The rules about inf/NaN gradients: ``skip_storm`` (too many steps skipped),
``inf_hotspot`` (one rank/device holds most detections), ``nonfinite_update_applied`` (an
optimizer step ran on them) and ``nonfinite_skipped`` (a watch under policy ``skip`` skipped
steps for them), over what changed within each rule's window.

``skip_storm`` and ``inf_hotspot`` leave out what the fault rule called the loss scaler's
weather (``RankTotals.weather``): a warm-up from a high ``init_scale``, the growth probes and
the overflows at the scaler's edge skip steps by design, and they land on whichever device
holds the largest gradients, so counting them would page healthy fp16 runs.

Pure functions: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ampscope.verdicts.ranks import RankRef, is_scaler
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, affected, rule_verdicts


@dataclass(frozen=True, kw_only=True)
class StepFacts(RankRef):
    """What ``skip_storm`` reads of a rank: its steps and skips within the window."""

    steps: int
    skipped: int
    weather: int = 0
    """Of ``skipped``, the steps the fault rule called the loss scaler's weather, which the
    rule does not count; 0 where the source left them out already (Prometheus' queries) or
    cannot tell them (a reporter that predates the count: every skip counts)."""


@dataclass(frozen=True, kw_only=True)
class InfFacts(RankRef):
    """What ``inf_hotspot`` reads of a rank: found-inf detections per device within the
    window, local (after the reduction) and at their origin (before it)."""

    local: Mapping[str, int]
    origin: Mapping[str, int]
    weather_local: Mapping[str, int] = field(default_factory=dict)
    """Per device, the part of ``local`` on iterations the fault rule called the scaler's
    weather: not counted (empty where the source left it out already or cannot tell)."""
    weather_origin: Mapping[str, int] = field(default_factory=dict)
    """The same for ``origin``."""

    def counted(self, source: Literal["local", "origin"]) -> dict[str, int]:
        """Per device, the ``source`` (``local`` or ``origin``) detections the rule counts."""
        found, weather = (
            (self.local, self.weather_local)
            if source == "local"
            else (self.origin, self.weather_origin)
        )
        return {device: max(0, n - weather.get(device, 0)) for device, n in found.items()}


def skip_storm(ranks: Sequence[StepFacts], t: Thresholds) -> Verdict:
    """Warning when a rank skipped more than ``skip_storm_ratio`` of its window's steps for
    inf/NaN that the fault rule did not call the loss scaler's weather (a watch has none:
    every skip counts)."""
    say = rule_verdicts("skip_storm", t)
    hits: list[dict[str, Any]] = []
    worst_ratio = 0.0
    for facts in ranks:
        steps = facts.steps
        if steps < t.skip_storm_min_steps:
            continue
        skipped = max(0, facts.skipped - facts.weather)
        ratio = skipped / steps
        worst_ratio = max(worst_ratio, ratio)
        if ratio > t.skip_storm_ratio:
            who = facts.ref()
            hits.append({**who, "steps": steps, "skipped": skipped, "ratio": ratio})
    if not hits:
        return say("ok", "skipped steps within bounds", {"worst_ratio": worst_ratio})
    worst = max(hits, key=lambda h: h["ratio"])
    return say(
        "warning",
        f"{worst['skipped']} of rank {worst['rank']}'s last {worst['steps']} steps "
        f"were skipped ({worst['ratio']:.0%}) on {len(hits)} rank(s), not counting the "
        "loss scaler's weather",
        affected(hits),
    )


def inf_hotspot(ranks: Sequence[InfFacts], t: Thresholds) -> Verdict:
    """Warning when one rank/device holds ``hotspot_share`` of the window's detections.

    Counts origin detections (pre-reduction gradients) when any rank tracks origin in
    the window, else local found-inf; either without those on iterations the fault rule
    called the loss scaler's weather (a warm-up's or a growth probe's overflow lands on the
    device with the largest gradients, a healthy one). Needs at least two rank/device
    series: a single device is trivially 100% of its own detections.
    """
    say = rule_verdicts("inf_hotspot", t)
    origin = [(f, device, n) for f in ranks for device, n in f.counted("origin").items()]
    local = [(f, device, n) for f in ranks for device, n in f.counted("local").items()]
    source, series = ("origin", origin) if sum(n for *_, n in origin) > 0 else ("local", local)
    total = sum(n for *_, n in series)
    evidence: dict[str, Any] = {"source": source, "detections": total, "series": len(series)}
    if total == 0 or len(series) < 2:
        return say("ok", "no rank/device dominates the found-inf detections", evidence)
    ordered = sorted(series, key=lambda item: -item[2])
    top: list[dict[str, Any]] = [
        {**s.ref(), "device": d, "detections": n, "share": n / total}
        for s, d, n in ordered[:5]
        if n > 0
    ]
    evidence["top"] = top
    lead = top[0]
    if total >= t.hotspot_min_detections and lead["share"] >= t.hotspot_share:
        return say(
            "warning",
            f"rank {lead['rank']} device {lead['device']} holds {lead['share']:.0%} "
            f"of {total} {source} found-inf detections",
            evidence,
        )
    return say("ok", "no rank/device dominates the found-inf detections", evidence)


def _origin(at_step: Sequence[tuple[int, bool | None]]) -> tuple[list[int], bool, str]:
    """From (rank, its own gradients held inf/NaN) at one step: the origin ranks (ascending),
    whether any rank tracked origin, and the words for it."""
    origins = sorted(rank for rank, origin in at_step if origin)
    tracked = any(origin is not None for _, origin in at_step)
    if origins:
        text = "origin: rank(s) " + ", ".join(map(str, origins[:MAX_EVIDENCE_RANKS]))
    elif tracked and all(origin is not None for _, origin in at_step):
        # Every rank's own gradients were finite: the sum of them was not.
        text = (
            "origin: no rank held inf/NaN of its own at that step: born in the cross-rank "
            "reduction (finite gradients whose sum overflowed)"
        )
    elif tracked:
        text = "origin: no rank that tracks it held inf/NaN of its own at that step"
    else:
        text = "origin not tracked (attach(model, track_origin=True) names it)"
    return origins, tracked, text


@dataclass(frozen=True, kw_only=True)
class AppliedFacts(RankRef):
    """What ``nonfinite_update_applied`` reads of a rank whose optimizer stepped on inf/NaN
    gradients (a watch under policy ``observe``, or a DeepSpeed engine, bf16 or fp16, that
    applied them) since its process started."""

    first_step: int
    """Its first such step (``RankTotals.first_nonfinite_applied``)."""
    origin: bool | None
    """Whether its own gradients held inf/NaN at that step; ``None``: origin not tracked."""
    applied: int
    """Optimizer steps it ran on inf/NaN gradients (``RankTotals.nonfinite_applied``)."""
    policy: str


def nonfinite_update_applied(ranks: Sequence[AppliedFacts]) -> Verdict:
    """Critical once a rank's optimizer step ran on inf/NaN gradients: the weights hold
    inf/NaN from then on, so no window ends it; a restart (counters from zero, e.g. from a
    checkpoint) does.

    Names the run's first such step (the lowest ``first_step`` of its ranks) and the ranks
    whose own gradients held inf/NaN at that step (origin tracking). O(ranks log ranks).
    """
    say = rule_verdicts("nonfinite_update_applied")
    hits = sorted(ranks, key=lambda facts: (facts.first_step, facts.rank))
    if not hits:
        return say("ok", "no optimizer step ran on inf/NaN gradients", {"ranks_affected": 0})
    first_step = hits[0].first_step
    origins, tracked, origin = _origin(
        [(f.rank, f.origin) for f in hits if f.first_step == first_step]
    )
    applied = sum(facts.applied for facts in hits)
    return say(
        "critical",
        f"{len(hits)} rank(s) applied {applied} optimizer step(s) on inf/NaN gradients: "
        f"the weights hold inf/NaN since step {first_step}; {origin}",
        {
            "first_step": first_step,
            "origin_tracked": tracked,
            "origin_ranks": origins[:MAX_EVIDENCE_RANKS],
            "ranks_affected": len(hits),
            "updates_applied": applied,
            "ranks": [
                {
                    **facts.ref(),
                    "first_step": facts.first_step,
                    "origin": facts.origin,
                    "updates_applied": facts.applied,
                    "policy": facts.policy,
                }
                for facts in hits[:MAX_EVIDENCE_RANKS]
            ],
        },
    )


@dataclass(frozen=True, kw_only=True)
class SkippedFacts(RankRef):
    """What ``nonfinite_skipped`` reads of a rank: what it runs, how many steps it skipped
    within the window, and its newest skipped step in the window, where the source holds it
    (an exporter; not Prometheus, which holds only the counter)."""

    mode: str | None
    """``Setup.mode``; ``None`` from a source that predates it (a scaler)."""
    policy: str
    skipped: int
    """Steps it skipped within ``nonfinite_skipped_window_s``."""
    last_step: int | None = None
    """Its newest skipped step within the window; ``None`` where unknown."""
    origin: bool | None = None
    """Whether its own gradients held inf/NaN at ``last_step``; ``None``: not tracked."""


def nonfinite_skipped(ranks: Sequence[SkippedFacts], t: Thresholds) -> Verdict:
    """Warning while a watch under policy ``skip`` skipped steps for inf/NaN gradients within
    ``nonfinite_skipped_window_s``: how many (the most any rank skipped: under ``skip`` the
    ranks agree and skip together), the newest such step and the ranks whose own gradients
    held inf/NaN at it (origin tracking). Scalers are left out: skipping an overflowed step
    is how a loss scaler works (``skip_storm`` judges how often). O(ranks).
    """
    say = rule_verdicts("nonfinite_skipped", t)
    window = f"{t.nonfinite_skipped_window_s:g} s"
    watched = [f for f in ranks if not is_scaler(f.mode) and f.policy == "skip"]
    hits = sorted((f for f in watched if f.skipped > 0), key=lambda f: f.rank)
    if not hits:
        summary = f"no step skipped for inf/NaN gradients within {window}"
        if not watched:
            summary = "no rank runs a watch under policy skip"
        return say("ok", summary, {"ranks_affected": 0})
    skipped = max(f.skipped for f in hits)
    summary = f"{skipped} step(s) skipped for inf/NaN gradients within {window} (watch policy skip)"
    evidence: dict[str, Any] = {"skipped": skipped}
    steps = [f.last_step for f in hits if f.last_step is not None]
    if steps:
        last = max(steps)
        origins, tracked, origin = _origin(
            [(f.rank, f.origin) for f in hits if f.last_step == last]
        )
        summary += f", the last at step {last}; {origin}"
        evidence |= {"last_step": last, "origin_tracked": tracked, "origin_ranks": origins}
    listed = [
        {**f.ref(), "skipped": f.skipped, "last_step": f.last_step, "origin": f.origin}
        for f in hits
    ]
    return say("warning", summary, affected(listed, **evidence))
