"""Instability verdicts for one run, computed from rank snapshots.

Pure functions of (snapshots, now, thresholds): no lock, no I/O, no clock of their own,
so tests drive them with hand-made times. Windowed rules difference the cumulative
totals of a rank's window samples (one per accepted batch) against the sample at the
window's start, as Prometheus' ``increase()`` does, so they stay exact however long
the window and however small the record history.

A rank takes part in a windowed rule while its last report lies within that rule's
window (scale desync: the collapse window), so a run that just died still shows what
killed it, and a rank that left long ago stops counting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.exporter.api.models import HealthReport, Status, Verdict
from ampscope.exporter.state.lifecycle import STATES, Lifecycle, RankStateName
from ampscope.exporter.state.ranks import RankSnapshot, WindowCounts
from ampscope.exporter.state.spike_windows import SpikeKindName
from ampscope.verdicts import fp8 as fp8_rules
from ampscope.verdicts import rules
from ampscope.verdicts import spikes as spike_rules
from ampscope.verdicts.rules import (
    MAX_EVIDENCE_RANKS,
    NO_SCALE,
    RankFacts,
    Thresholds,
    progress_summary,
)

log = logging.getLogger(__name__)

Rule = Callable[[Sequence["RankSnapshot"], float, "Thresholds"], Verdict]

MAX_LOGGED = 1024
"""(rule, run, rank) left out of a verdict that are logged, once each; then no more."""
_logged: set[tuple[str, str, int]] = set()

_SEVERITY: dict[Status, int] = {"ok": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class _Window:
    """A rank's change over a window: its baseline counters (``None``: zero) and the
    highest scale seen in it."""

    baseline: WindowCounts | None
    peak_scale: float


def _window(snap: RankSnapshot, start: float) -> _Window:
    anchor = None
    peak = snap.newest.scale_after
    for sample in snap.samples:
        if sample.received <= start:
            anchor = sample  # the newest sample at or before the start is the baseline
        else:
            peak = max(peak, sample.peak_scale)
    if anchor is not None:
        return _Window(baseline=anchor.counts, peak_scale=max(peak, anchor.scale))
    if snap.first_step != 1 and snap.samples:
        # Heard mid-run (the exporter restarted): count from the first batch heard.
        return _Window(baseline=snap.samples[0].counts, peak_scale=peak)
    # Heard from its first step on: the baseline is zero.
    return _Window(baseline=None, peak_scale=peak)


def _delta(now: Mapping[str, int], base: Mapping[str, int] | None) -> dict[str, int]:
    base = base or {}
    return {key: count - base.get(key, 0) for key, count in now.items()}


def _who(snap: RankSnapshot) -> dict[str, Any]:
    return {"rank": snap.identity.rank, "node": snap.identity.node}


def _scalers(ranks: Sequence[RankSnapshot]) -> list[RankSnapshot]:
    """The ranks that run a loss scaler: a watch's records carry scale 1, which is no scale."""
    return [snap for snap in ranks if snap.newest.setup.mode == "scaler"]


def scale_collapse(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rules.scale_collapse`` over the store's snapshots: O(ranks x samples)."""
    facts = [
        rules.ScaleFacts(
            rank=snap.identity.rank,
            node=snap.identity.node,
            scaler=snap.newest.setup.mode == "scaler",
            scale=snap.newest.scale_after,
            window_peak_scale=_window(snap, now - t.collapse_window_s).peak_scale,
        )
        for snap in ranks
    ]
    return rules.scale_collapse(facts, t)


def skip_storm(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rules.skip_storm`` over the store's snapshots: O(ranks x samples)."""
    facts = []
    for snap in ranks:
        base = _window(snap, now - t.skip_storm_window_s).baseline
        totals = snap.newest.totals
        facts.append(
            rules.StepFacts(
                rank=snap.identity.rank,
                node=snap.identity.node,
                steps=totals.steps - (base.steps if base else 0),
                skipped=totals.skipped_steps - (base.skipped_steps if base else 0),
            )
        )
    return rules.skip_storm(facts, t)


def scale_desync(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """Critical when ranks report different ``scale_after`` for the same step.

    Compares the held histories of ranks that reported within the collapse window:
    O(ranks x history_length).
    """
    del now
    thresholds = {"window_s": t.collapse_window_s}
    by_step: dict[int, set[float]] = {}
    seen: dict[int, int] = {}
    scalers = _scalers(ranks)
    for snap in scalers:
        for record in snap.history:
            by_step.setdefault(record.step, set()).add(record.scale_after)
            seen[record.step] = seen.get(record.step, 0) + 1
    compared = sum(1 for count in seen.values() if count > 1)
    mismatched = sorted(step for step, scales in by_step.items() if len(scales) > 1)
    if not mismatched:
        return Verdict(
            rule="scale_desync",
            status="ok",
            summary=f"ranks agree on the scale at {compared} shared step(s)"
            if scalers or not ranks
            else NO_SCALE,
            evidence={"compared_steps": compared},
            thresholds=thresholds,
        )
    step = mismatched[-1]
    scales = {}
    for snap in scalers:
        for record in snap.history:
            if record.step == step:
                scales[str(snap.identity.rank)] = record.scale_after
                break
        if len(scales) >= MAX_EVIDENCE_RANKS:
            break
    return Verdict(
        rule="scale_desync",
        status="critical",
        summary=f"ranks disagree on the loss scale at {len(mismatched)} of {compared} shared "
        f"step(s); newest: step {step}",
        evidence={
            "compared_steps": compared,
            "mismatched_steps": len(mismatched),
            "first_mismatched_step": mismatched[0],
            "newest_mismatched_step": step,
            "scales_at_newest": scales,
        },
        thresholds=thresholds,
    )


def _states(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> list[RankStateName]:
    life = Lifecycle(stale_after_s=t.stale_after_s, stall_after_s=t.stall_after_s)
    return [life.state(snap, now) for snap in ranks]


def facts_of(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> list[RankFacts]:
    """The neutral view of ``ranks`` at exporter time ``now`` that the shared rules of
    ``ampscope.verdicts.rules`` read. O(ranks)."""
    states = _states(ranks, now, t)
    return [
        RankFacts(
            rank=snap.identity.rank,
            node=snap.identity.node,
            state=state,
            world_size=snap.identity.world_size,
            local_world_size=snap.identity.local_world_size,
            last_step=snap.newest.step,
            last_report_time=snap.last_report,
            seconds_since_report=now - snap.last_report,
        )
        for snap, state in zip(ranks, states, strict=True)
    ]


def lost_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``ampscope.verdicts.rules.lost_rank`` over the store's snapshots."""
    return rules.lost_rank(facts_of(ranks, now, t), t)


def missing_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``ampscope.verdicts.rules.missing_rank`` over the store's snapshots, judged only when
    the ranks say their node holds the whole job (``rules.whole_job``)."""
    facts = facts_of(ranks, now, t)
    return rules.missing_rank(facts, judged=rules.whole_job(facts))


def stalled_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """Warning when a rank is still heard from but took no new step for ``stall_after_s``.

    When every live (running or stalled) rank stalled, the run hangs: the rank whose last
    step is lowest, or at equal steps whose last step is oldest on its own clock, is named
    as the likely culprit (the others typically wait for it in a collective).
    """
    thresholds = {"stall_after_s": t.stall_after_s}
    states = _states(ranks, now, t)
    stalled = [s for s, state in zip(ranks, states, strict=True) if state == "stalled"]
    live = sum(1 for state in states if state in ("running", "stalled"))
    if not stalled:
        return Verdict(
            rule="stalled_rank",
            status="ok",
            summary=progress_summary(live, states),
            evidence={"stalled": 0, "live": live},
            thresholds=thresholds,
        )
    listed = [
        {
            **_who(snap),
            "last_step": snap.newest.step,
            "step_time": snap.newest.time,
            "seconds_since_progress": now - snap.last_progress,
        }
        for snap in sorted(stalled, key=lambda snap: (snap.newest.step, snap.newest.time))
    ]
    evidence: dict[str, Any] = {
        "stalled": len(stalled),
        "live": live,
        "ranks": listed[:MAX_EVIDENCE_RANKS],
    }
    summary = (
        f"{len(stalled)} of {live} live rank(s) still report but took no step for over "
        f"{t.stall_after_s:g} s"
    )
    if len(stalled) == live:
        culprit = listed[0]
        evidence["culprit"] = culprit
        summary += (
            f"; every live rank stalled (a hang?): rank {culprit['rank']} (node "
            f"{culprit['node']}) stopped first, at step {culprit['last_step']}: the likely "
            "culprit"
        )
    return Verdict(
        rule="stalled_rank",
        status="warning",
        summary=summary,
        evidence=evidence,
        thresholds=thresholds,
    )


def inf_hotspot(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rules.inf_hotspot`` over the store's snapshots: O(ranks x samples)."""
    facts = []
    for snap in ranks:
        base = _window(snap, now - t.hotspot_window_s).baseline
        totals = snap.newest.totals
        facts.append(
            rules.InfFacts(
                rank=snap.identity.rank,
                node=snap.identity.node,
                local=_delta(totals.found_inf_local, base.found_inf_local if base else None),
                origin=_delta(totals.found_inf_origin, base.found_inf_origin if base else None),
            )
        )
    return rules.inf_hotspot(facts, t)


def nonfinite_update_applied(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """Critical once a rank's optimizer step ran on inf/NaN gradients (a watch under policy
    ``observe``): the weights hold inf/NaN from then on, so no window ends it; a restart
    (counters from zero, e.g. from a checkpoint) does.

    Names the run's first such step (the lowest ``first_nonfinite_applied`` of its ranks)
    and the ranks whose own gradients held inf/NaN at that step (origin tracking). O(ranks).
    """
    del now, t
    hits = sorted(
        (
            (first.step, snap.identity.rank, snap, first)
            for snap in ranks
            if (first := snap.newest.totals.first_nonfinite_applied) is not None
        ),
        key=lambda hit: hit[:2],
    )
    if not hits:
        return Verdict(
            rule="nonfinite_update_applied",
            status="ok",
            summary="no optimizer step ran on inf/NaN gradients",
            evidence={"ranks_affected": 0},
            thresholds={},
        )
    first_step = hits[0][0]
    at_first = [first for step, _, _, first in hits if step == first_step]
    origins = [rank for step, rank, _, first in hits if step == first_step and first.origin]
    tracked = any(first.origin is not None for first in at_first)
    if origins:
        origin = "origin: rank(s) " + ", ".join(map(str, origins[:MAX_EVIDENCE_RANKS]))
    elif tracked:
        origin = "origin: no rank that tracks it held inf/NaN of its own at that step"
    else:
        origin = "origin not tracked (attach(model, track_origin=True) names it)"
    applied = sum(snap.newest.totals.nonfinite_applied for _, _, snap, _ in hits)
    return Verdict(
        rule="nonfinite_update_applied",
        status="critical",
        summary=f"{len(hits)} rank(s) applied {applied} optimizer step(s) on inf/NaN gradients: "
        f"the weights hold inf/NaN since step {first_step}; {origin}",
        evidence={
            "first_step": first_step,
            "origin_tracked": tracked,
            "origin_ranks": origins[:MAX_EVIDENCE_RANKS],
            "ranks_affected": len(hits),
            "updates_applied": applied,
            "ranks": [
                {
                    **_who(snap),
                    "first_step": first.step,
                    "origin": first.origin,
                    "updates_applied": snap.newest.totals.nonfinite_applied,
                    "policy": snap.newest.setup.policy,
                }
                for _, _, snap, first in hits[:MAX_EVIDENCE_RANKS]
            ],
        },
        thresholds={},
    )


def spike_facts(
    ranks: Sequence[RankSnapshot], kind: SpikeKindName, now: float, t: Thresholds
) -> list[spike_rules.SpikeFacts]:
    """Each rank's spikes of ``kind`` found within ``spike_verdict_window_s`` before ``now``
    (exporter clock), with the newest one's details. O(ranks x MAX_RECENT_SPIKES)."""
    start = now - t.spike_verdict_window_s
    facts = []
    for snap in ranks:
        within = [e for e in snap.spikes if e.kind == kind and start <= e.received <= now]
        if not within:
            continue
        newest = within[-1]
        facts.append(
            spike_rules.SpikeFacts(
                rank=snap.identity.rank,
                node=snap.identity.node,
                spikes=len(within),
                newest=spike_rules.SpikeDetail(
                    step=newest.step,
                    value=newest.value,
                    median=newest.median,
                    mean=newest.mean,
                    stdev=newest.stdev,
                    compared=newest.compared,
                    top_params=newest.top_params,
                ),
            )
        )
    return facts


def loss_spike(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``spike_rules.loss_spike`` over the store's snapshots."""
    return spike_rules.loss_spike(spike_facts(ranks, "loss", now, t), t)


def grad_norm_spike(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``spike_rules.grad_norm_spike`` over the store's snapshots."""
    return spike_rules.grad_norm_spike(spike_facts(ranks, "grad_norm", now, t), t)


def origin_outlier(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``spike_rules.origin_outlier`` over the store's snapshots: the ranks of this exporter only
    (one node's), compared at equal steps as they arrived."""
    return spike_rules.origin_outlier(spike_facts(ranks, "origin_outlier", now, t), t)


def _isolated(rule: Rule, ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rule`` over ``ranks``, leaving out any rank it cannot evaluate on its own.

    Schema bounds make a failure a bug rather than an input; this keeps one rank's data
    from failing the run's whole report. Costs one extra pass per rank only on failure.
    """
    try:
        return rule(ranks, now, t)
    except (ArithmeticError, ValueError, TypeError):
        good = []
        for snap in ranks:
            try:
                rule([snap], now, t)
            except (ArithmeticError, ValueError, TypeError) as exc:
                key = (rule.__name__, snap.identity.run, snap.identity.rank)
                if key not in _logged and len(_logged) < MAX_LOGGED:
                    _logged.add(key)
                    log.error(
                        "rank %d of run %r left out of %s: %s: %s",
                        snap.identity.rank,
                        snap.identity.run,
                        rule.__name__,
                        type(exc).__name__,
                        exc,
                    )
            else:
                good.append(snap)
        return rule(good, now, t)


def fp8_facts(ranks: Sequence[RankSnapshot]) -> list[fp8_rules.Fp8Facts]:
    """The FP8 series of ``ranks`` as the FP8 rules read them. O(series)."""
    return [
        fp8_rules.Fp8Facts(
            rank=snap.identity.rank,
            node=snap.identity.node,
            layer=series.layer,
            tensor=series.tensor,
            step=series.step,
            underflow_recent=series.underflow_recent,
            spike=series.spike,
            nonfinite=series.nonfinite,
        )
        for snap in ranks
        for series in snap.fp8
    ]


def evaluate(
    run: str,
    ranks: Sequence[RankSnapshot],
    now: float,
    t: Thresholds,
    *,
    fp8: fp8_rules.Fp8Rule | None = None,
) -> HealthReport:
    """Every rule over one run's ranks. Cost: O(ranks x (samples + history_length)), plus
    O(FP8 series) for the FP8 rules (``fp8``: their thresholds; default the defaults).

    A run whose ranks all finished is judged as it ended: the instability rules are
    evaluated at the time of its last final record, so its report stays the same however
    long it is kept, and liveness rules have nothing to say (every rank said goodbye).
    """
    states = _states(ranks, now, t)
    finished = bool(ranks) and all(state == "finished" for state in states)
    at = max(snap.finished_at or 0.0 for snap in ranks) if finished else now

    def recent(window_s: float) -> list[RankSnapshot]:
        return [snap for snap in ranks if snap.reported_within(at, window_s)]

    verdicts = [
        _isolated(scale_collapse, recent(t.collapse_window_s), at, t),
        _isolated(skip_storm, recent(t.skip_storm_window_s), at, t),
        _isolated(scale_desync, recent(t.collapse_window_s), at, t),
        _isolated(lost_rank, ranks, now, t),
        _isolated(missing_rank, ranks, now, t),
        _isolated(stalled_rank, ranks, now, t),
        _isolated(inf_hotspot, recent(t.hotspot_window_s), at, t),
        _isolated(nonfinite_update_applied, ranks, at, t),
        _isolated(loss_spike, ranks, at, t),
        _isolated(grad_norm_spike, ranks, at, t),
        _isolated(origin_outlier, ranks, at, t),
    ]
    series = fp8_facts(ranks)
    if series:  # the FP8 rules speak only of runs with FP8 layers
        rule = fp8 or fp8_rules.Fp8Rule()
        window_s = t.spike_verdict_window_s
        verdicts += [
            fp8_rules.fp8_amax_spike(series, rule, at, window_s),
            fp8_rules.fp8_underflow(series, rule),
            fp8_rules.fp8_nonfinite_amax(series, at, window_s),
        ]
    status = max((v.status for v in verdicts), key=_SEVERITY.__getitem__)
    return HealthReport(
        run=run,
        status=status,
        state="finished" if finished else "active",
        evaluated_at=now,
        ranks=len(ranks),
        up=sum(1 for snap in ranks if snap.reported_within(now, t.stale_after_s)),
        states={name: states.count(name) for name in STATES},
        verdicts=verdicts,
    )
