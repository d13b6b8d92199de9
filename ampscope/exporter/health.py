"""The health of one run from the store's rank snapshots: each rule of ``ampscope.verdicts``
fed the facts it reads, in report order, and the run's roll-up.

The rules themselves live in ``ampscope.verdicts``, shared with ``ampscope status``; this
module builds their facts from snapshots. Pure functions of (snapshots, now, thresholds):
no lock, no I/O, no clock of their own, so tests drive them with hand-made times. Windowed
rules difference the cumulative totals of a rank's window samples (one per accepted batch)
against the sample at the window's start, as Prometheus' ``increase()`` does, so they stay
exact however long the window and however small the record history.

A rank takes part in a windowed rule while its last report lies within that rule's
window (scale desync: the collapse window), so a run that just died still shows what
killed it, and a rank that left long ago stops counting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.exporter.api.models import HealthReport
from ampscope.exporter.state.lifecycle import Lifecycle
from ampscope.exporter.state.pauses import HeldPause
from ampscope.exporter.state.ranks import RankSnapshot, WindowCounts
from ampscope.exporter.state.reruns import RerunResult
from ampscope.exporter.state.spike_windows import SpikeKindName
from ampscope.verdicts import batches as batch_verdicts
from ampscope.verdicts import failures, liveness, nonfinite, scale
from ampscope.verdicts import fp8 as fp8_rules
from ampscope.verdicts import replicas as replica_rules
from ampscope.verdicts import reruns as rerun_rules
from ampscope.verdicts import spikes as spike_rules
from ampscope.verdicts.ranks import LIVE_STATES, RankFacts, RankPaused, is_scaler
from ampscope.verdicts.rollup import health_report, run_ended
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import RULES, RuleName, Verdict

log = logging.getLogger(__name__)

Rule = Callable[[Sequence["RankSnapshot"], float, "Thresholds"], Verdict]

MAX_LOGGED = 1024
"""(rule, run, rank) left out of a verdict that are logged, once each; then no more."""
_logged: set[tuple[str, str, int]] = set()


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


def _delta(now: Mapping[str, int], base: Mapping[str, int]) -> dict[str, int]:
    return {key: count - base.get(key, 0) for key, count in now.items()}


@dataclass(frozen=True)
class _Increase:
    """How much a rank's counters rose over a window; the ``weather_*`` counts are the part
    the fault rule called the loss scaler's weather (0 and empty from a reporter that
    predates the count, so its consumers count everything, as before it)."""

    steps: int
    skipped_steps: int
    found_inf_local: Mapping[str, int]
    found_inf_origin: Mapping[str, int]
    weather_skipped_steps: int
    weather_found_inf_local: Mapping[str, int]
    weather_found_inf_origin: Mapping[str, int]


_NO_COUNTS: dict[str, int] = {}


def _increase(snap: RankSnapshot, start: float) -> _Increase:
    """How much the rank's counters rose since exporter time ``start``, as Prometheus'
    ``increase()`` would: O(samples)."""
    now = WindowCounts.of(snap.newest.totals)
    base = _window(snap, start).baseline
    weather = now.weather
    if weather is None:
        return _Increase(
            *_rose(now, base),
            weather_skipped_steps=0,
            weather_found_inf_local=_NO_COUNTS,
            weather_found_inf_origin=_NO_COUNTS,
        )
    # A baseline without the field (none in one process) counts from zero.
    was = None if base is None else base.weather
    return _Increase(
        *_rose(now, base),
        weather_skipped_steps=weather.skipped_steps - (0 if was is None else was.skipped_steps),
        weather_found_inf_local=_delta(
            weather.found_inf_local, _NO_COUNTS if was is None else was.found_inf_local
        ),
        weather_found_inf_origin=_delta(
            weather.found_inf_origin, _NO_COUNTS if was is None else was.found_inf_origin
        ),
    )


def _rose(
    now: WindowCounts, base: WindowCounts | None
) -> tuple[int, int, Mapping[str, int], Mapping[str, int]]:
    if base is None:
        return now.steps, now.skipped_steps, now.found_inf_local, now.found_inf_origin
    return (
        now.steps - base.steps,
        now.skipped_steps - base.skipped_steps,
        _delta(now.found_inf_local, base.found_inf_local),
        _delta(now.found_inf_origin, base.found_inf_origin),
    )


def _who(snap: RankSnapshot) -> dict[str, Any]:
    return {"rank": snap.identity.rank, "node": snap.identity.node}


def scale_collapse(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``scale.scale_collapse`` over the store's snapshots: O(ranks x samples)."""
    facts = [
        scale.ScaleFacts(
            **_who(snap),
            scaler=is_scaler(snap.newest.setup.mode),
            scale=snap.newest.scale_after,
            window_peak_scale=_window(snap, now - t.collapse_window_s).peak_scale,
        )
        for snap in ranks
    ]
    return scale.scale_collapse(facts, t)


def skip_storm(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``nonfinite.skip_storm`` over the store's snapshots: O(ranks x samples)."""
    rose = [(snap, _increase(snap, now - t.skip_storm_window_s)) for snap in ranks]
    facts = [
        nonfinite.StepFacts(
            **_who(snap),
            steps=counts.steps,
            skipped=counts.skipped_steps,
            weather=counts.weather_skipped_steps,
        )
        for snap, counts in rose
    ]
    return nonfinite.skip_storm(facts, t)


def scale_desync(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``scale.scale_desync`` over the ranks' aligned scales (their newest records' totals),
    as ``ampscope status`` and Prometheus compare them: O(ranks)."""
    del now, t
    facts = []
    for snap in ranks:
        aligned = snap.newest.totals.aligned_scale
        facts.append(
            scale.AlignedFacts(
                **_who(snap),
                scaler=is_scaler(snap.newest.setup.mode),
                step=None if aligned is None else aligned.step,
                scale=None if aligned is None else aligned.scale,
            )
        )
    return scale.scale_desync(facts)


def _states(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> list[str]:
    life = Lifecycle.of(t)
    return [life.state(snap, now) for snap in ranks]


def _paused(pause: HeldPause | None, now: float) -> RankPaused | None:
    return None if pause is None else RankPaused(reason=pause.reason, seconds=pause.seconds(now))


def facts_of(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> list[RankFacts]:
    """The neutral view of ``ranks`` at exporter time ``now`` that the liveness rules of
    ``ampscope.verdicts.liveness`` read. O(ranks)."""
    states = _states(ranks, now, t)
    life = Lifecycle.of(t)
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
            step_time=snap.newest.time,
            seconds_since_progress=now - snap.last_progress,
            pause=_paused(life.pause_of(snap) if state in LIVE_STATES else None, now),
        )
        for snap, state in zip(ranks, states, strict=True)
    ]


def lost_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``liveness.lost_rank`` over the store's snapshots."""
    return liveness.lost_rank(facts_of(ranks, now, t), t)


def missing_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``liveness.missing_rank`` over the store's snapshots, judged only when the ranks say
    their node holds the whole job (``liveness.whole_job``)."""
    facts = facts_of(ranks, now, t)
    return liveness.missing_rank(facts, judged=liveness.whole_job(facts))


def stalled_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``liveness.stalled_rank`` over the store's snapshots, with each rank's progress times."""
    return liveness.stalled_rank(facts_of(ranks, now, t), t)


def stopped_rank(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``liveness.stopped_rank`` over the store's snapshots, judged only when the ranks say
    their node holds the whole job (``liveness.whole_job``): a view of every node judges the
    others."""
    facts = facts_of(ranks, now, t)
    return liveness.stopped_rank(facts, t, judged=liveness.whole_job(facts))


def rank_failed(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``failures.rank_failed`` over the store's snapshots: the failed ranks and what their
    final heartbeats said training ended on. O(ranks)."""
    facts = [
        failures.FailedFacts(
            **_who(snap),
            kind=failure.kind,
            exception=failure.exception,
            message=failure.message,
            step=failure.step,
            origin_ranks=None if failure.origin_ranks is None else tuple(failure.origin_ranks),
        )
        for snap, state in zip(ranks, _states(ranks, now, t), strict=True)
        if state == "failed" and (failure := snap.failure) is not None
    ]
    return failures.rank_failed(facts, len(ranks))


def inf_hotspot(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``nonfinite.inf_hotspot`` over the store's snapshots: O(ranks x samples)."""
    rose = [(snap, _increase(snap, now - t.hotspot_window_s)) for snap in ranks]
    facts = [
        nonfinite.InfFacts(
            **_who(snap),
            local=c.found_inf_local,
            origin=c.found_inf_origin,
            weather_local=c.weather_found_inf_local,
            weather_origin=c.weather_found_inf_origin,
        )
        for snap, c in rose
    ]
    return nonfinite.inf_hotspot(facts, t)


def nonfinite_update_applied(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``nonfinite.nonfinite_update_applied`` over the store's snapshots: no window, as the
    weights stay non-finite until the process restarts (counters from zero). O(ranks)."""
    del now, t
    facts = [
        nonfinite.AppliedFacts(
            **_who(snap),
            first_step=first.step,
            origin=first.origin,
            applied=snap.newest.totals.nonfinite_applied,
            policy=snap.newest.setup.policy,
        )
        for snap in ranks
        if (first := snap.newest.totals.first_nonfinite_applied) is not None
    ]
    return nonfinite.nonfinite_update_applied(facts)


def nonfinite_skipped(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``nonfinite.nonfinite_skipped`` over the store's snapshots: the steps each rank skipped
    within ``nonfinite_skipped_window_s`` (its counters' increase) and its newest skipped
    step, while that arrived within the window. O(ranks x samples)."""
    start = now - t.nonfinite_skipped_window_s
    facts = []
    for snap in ranks:
        skip = snap.last_skip
        if skip is not None and not start <= skip.received <= now:
            skip = None
        facts.append(
            nonfinite.SkippedFacts(
                **_who(snap),
                mode=snap.newest.setup.mode,
                policy=snap.newest.setup.policy,
                skipped=_increase(snap, start).skipped_steps,
                last_step=None if skip is None else skip.step,
                origin=None if skip is None else skip.origin,
            )
        )
    return nonfinite.nonfinite_skipped(facts, t)


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
                **_who(snap),
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


def rerun_facts(
    ranks: Sequence[RankSnapshot], result: RerunResult, now: float, t: Thresholds
) -> list[rerun_rules.RerunFacts]:
    """Each rank's reruns of ``result`` within ``spike_verdict_window_s`` before ``now``,
    with the newest one and the rank's device. O(ranks x MAX_RECENT_RERUNS)."""
    start = now - t.spike_verdict_window_s
    facts = []
    for snap in ranks:
        within = [e for e in snap.reruns if e.result == result and start <= e.received <= now]
        if not within:
            continue
        newest = within[-1]
        facts.append(
            rerun_rules.RerunFacts(
                **_who(snap),
                reruns=len(within),
                device=None if snap.device is None else snap.device.device,
                newest=rerun_rules.RerunDetail(
                    step=newest.step,
                    first_loss=newest.first_loss,
                    second_loss=newest.second_loss,
                    first_norm=newest.first_norm,
                    second_norm=newest.second_norm,
                ),
            )
        )
    return facts


def transient_fault(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rerun_rules.transient_fault`` over the store's snapshots."""
    return rerun_rules.transient_fault(rerun_facts(ranks, "transient", now, t), t)


def reproducible_fault(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``rerun_rules.reproducible_fault`` over the store's snapshots."""
    return rerun_rules.reproducible_fault(rerun_facts(ranks, "reproducible", now, t), t)


def replica_divergence(ranks: Sequence[RankSnapshot], now: float, t: Thresholds) -> Verdict:
    """``replica_rules.replica_divergence`` over the store's snapshots: each rank's
    diverged checks and its current process's first divergence. O(ranks)."""
    del now  # a divergence lasts as long as the process: no window
    facts = []
    for snap in ranks:
        first = snap.replica_divergence
        facts.append(
            replica_rules.ReplicaFacts(
                **_who(snap),
                diverged=snap.replica_counts.diverged,
                device=None if snap.device is None else snap.device.device,
                first=None
                if first is None
                else replica_rules.DivergenceDetail(
                    step=first.step,
                    ranks=first.ranks,
                    majority=first.majority,
                    parameters=first.parameters,
                    parameters_differing=first.parameters_differing,
                ),
            )
        )
    return replica_rules.replica_divergence(facts, t)


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


@dataclass(frozen=True)
class _Scope:
    """Which ranks a rule reads, and as of when."""

    rule: Rule
    window: Callable[[Thresholds], float] | None = None
    """Only the ranks heard within this window take part: a run that just died still shows
    what killed it, and a rank that left long ago stops counting."""
    live: bool = False
    """Judged at the exporter's clock even for a run that ended (liveness, failures):
    otherwise as of the run's last final record."""


_SCOPES: dict[RuleName, _Scope] = {
    "scale_collapse": _Scope(scale_collapse, lambda t: t.collapse_window_s),
    "skip_storm": _Scope(skip_storm, lambda t: t.skip_storm_window_s),
    "scale_desync": _Scope(scale_desync, lambda t: t.collapse_window_s),
    "lost_rank": _Scope(lost_rank, live=True),
    "missing_rank": _Scope(missing_rank, live=True),
    "stalled_rank": _Scope(stalled_rank, live=True),
    "stopped_rank": _Scope(stopped_rank, live=True),
    "rank_failed": _Scope(rank_failed, live=True),
    "inf_hotspot": _Scope(inf_hotspot, lambda t: t.hotspot_window_s),
    "nonfinite_update_applied": _Scope(nonfinite_update_applied),
    "nonfinite_skipped": _Scope(nonfinite_skipped),
    "loss_spike": _Scope(loss_spike),
    "grad_norm_spike": _Scope(grad_norm_spike),
    "origin_outlier": _Scope(origin_outlier),
    "transient_fault": _Scope(transient_fault),
    "reproducible_fault": _Scope(reproducible_fault),
    "replica_divergence": _Scope(replica_divergence),
}
"""Each rule of ``ampscope.verdicts.RULES`` over the store's snapshots, but the FP8 rules
(``FP8_RULES``: over the ranks' FP8 series, ``fp8_facts``)."""


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
    batch_ids: Callable[[set[tuple[int, int]]], Mapping[tuple[int, int], Sequence[int | str]]]
    | None = None,
    *,
    fp8: fp8_rules.Fp8Rule | None = None,
) -> HealthReport:
    """Every rule over one run's ranks, in report order (``RULES``); the FP8 rules only for a
    run with FP8 layers (``fp8``: their thresholds; default the defaults). Cost: O(ranks x
    samples), plus O(FP8 series) for the FP8 rules.

    ``batch_ids`` looks up the ids each (step, rank) the verdicts name had (the store's
    ``batch_ids``); they join those verdicts' evidence (``ampscope.verdicts.batches``).

    A run whose ranks all ended (finished, failed or stopped) is judged as it ended: the instability
    rules are evaluated at the time of its last final record, so its report stays the same
    however long it is kept, and liveness rules have nothing to say (every rank said
    goodbye). A failed rank makes ``rank_failed`` critical: a run that failed is never OK.
    """
    states = _states(ranks, now, t)
    at = max(snap.finished_at or 0.0 for snap in ranks) if run_ended(states) else now
    verdicts = []
    for scope in _SCOPES.values():
        when = now if scope.live else at
        held = ranks
        if scope.window is not None:
            window_s = scope.window(t)
            held = [snap for snap in ranks if snap.reported_within(when, window_s)]
        verdicts.append(_isolated(scope.rule, held, when, t))
    series = fp8_facts(ranks)
    if series:  # the FP8 rules speak only of runs with FP8 layers
        rule = fp8 or fp8_rules.Fp8Rule()
        window_s = t.spike_verdict_window_s
        verdicts += [
            fp8_rules.fp8_amax_spike(series, rule, at, window_s),
            fp8_rules.fp8_underflow(series, rule),
            fp8_rules.fp8_nonfinite_amax(series, at, window_s),
        ]
    verdicts.sort(key=lambda v: RULES.index(v.rule))
    if batch_ids is not None:
        verdicts = batch_verdicts.attach(verdicts, batch_ids)
    up = sum(1 for snap in ranks if snap.reported_within(now, t.stale_after_s))
    return HealthReport(**health_report(run, verdicts, states, evaluated_at=now, up=up))
