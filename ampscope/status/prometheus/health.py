"""``ampscope status --prometheus URL [RUN]``: the whole job read from Prometheus (or
VictoriaMetrics, or a Thanos/Mimir query frontend) through ``/api/v1/query`` only.

Builds the same answer as one exporter's ``--json`` (``ranks`` and ``health`` of a run, or
every run's), with ``null`` where Prometheus does not hold a value (a rank's step time,
last event, restarts, FP8 series: its gauges hold only ``fp8_max_layers`` layers a rank),
and computes the verdicts by the exporter's own rule implementations (``ampscope.verdicts``)
from instant vectors, ``max_over_time`` and counters' growth over each rule's window (the
counter less its smallest sample in the window, as the alerts count, so that a gap in the
scrapes counts no old count: ``ranks.grown_within``; ``skip_storm`` and ``inf_hotspot``
without the skips and detections the fault rule called the loss scaler's weather, as the
recording rules count them: ``counted_query``);
``scale_desync`` compares the ranks' aligned scales at the same aligned step, both read
from one sample (``ampscope_loss_scale_aligned_packed``; the two separate series from
exporters that predate it), as the alert rule does; ``rank_failed`` names the failed ranks from
``ampscope_rank_failure_info`` (the exception's class and each rank's origin; the step is
the rank's last, the message only the exporters hold). Verdicts
that need the exporter's per-step history (``stalled_rank``'s progress times,
``nonfinite_update_applied``'s first step and origin) say so instead. The spike verdicts
(``loss_spike``, ``grad_norm_spike``, ``origin_outlier``) count the growth of
``ampscope_spikes_total`` over their window: which rank and how many, not the step, value or
baseline, which only the exporters hold (``SPIKE_DETAIL``); ``nonfinite_skipped`` counts
the growth of ``ampscope_skipped_steps_total``, without the last step and its origin
(``SKIP_DETAIL``). ``transient_fault`` and ``reproducible_fault`` read
``ampscope_reruns_total`` counted within the verdicts' window (``spike_verdict_window_s``,
as the exporter and the alerts count; ``ranks.counted_within``): which rank and how many, not
the step or the device (``RERUN_DETAIL``); ``replica_divergence`` reads
``ampscope_replica_checks_total`` (since each rank process started): which ranks' groups
diverged, not which rank disagrees (``REPLICA_DETAIL``). For a run whose ranks export FP8
series, ``fp8_nonfinite_amax`` (from the non-finite amax counter) and ``fp8_underflow`` (from
the gauges' samples) are judged, ``fp8_amax_spike`` is not (``ampscope.status.prometheus.fp8``).

A rank whose series were there within the last hour and are gone now (its exporter's scrape
fails, or its series went stale) is ``lost``, as the exporter's own health would call a rank
it no longer hears (the alert ``AmpscopeNodeLost`` pages on the same condition over the
same hour), and ``lost_rank`` names it and the exporters whose scrape fails
(``ampscope.status.prometheus.ranks``). ``stopped_rank`` reads a stopped rank's stop as its
``ampscope_last_report_timestamp_seconds`` and its world as ``ampscope_rank_info``'s
``world_size``, of the ranks whose series are there, as ``AmpscopeRankStopped`` does. The
thresholds are those the exporters publish
(``ampscope_exporter_health_threshold``), the defaults where none does. Cost: one query for
the thresholds, then fifteen instant queries run in parallel, then, only where they found
any, a second round narrowed to the ranks concerned: the other states of the ranks not
running (the first round reads ``running``'s one series a rank), the steps of the ranks that
skipped, the separate aligned pair of the scalers without the packed sample, the families of
the gone ranks and the ranks of the failing exporters. The windowed counts answer with the
ranks that counted (``> 0``); every rank's gauges are one query, O(ranks x families) series.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from ampscope.reporter.fault_rule import FAULT_KINDS
from ampscope.status import merge, shapes
from ampscope.status.prometheus import fp8 as prometheus_fp8
from ampscope.status.prometheus.api import PrometheusClient, QueryError
from ampscope.status.prometheus.ranks import (
    GAUGES,
    LOOKBACK_S,
    build_views,
    counted_within,
    down_seen_query,
    exporters_down,
    gone_query,
    gone_ranks,
    grown_within,
    narrowed,
    not_running,
    other_state_query,
    per_rank,
    seen_query,
    separate_aligned_query,
    state_query,
    thresholds_of,
    up_query,
    without_packed,
)
from ampscope.verdicts import failures, liveness, nonfinite, scale
from ampscope.verdicts import replicas as replica_rules
from ampscope.verdicts import reruns as rerun_rules
from ampscope.verdicts import spikes as spike_rules
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.ranks import is_scaler, mode_of
from ampscope.verdicts.rollup import health_report
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import Verdict, in_report_order

NEEDS_HISTORY = {
    "stalled_rank": "each rank's time of its last new step, which only the exporters hold; "
    "ampscope_rank_state says which ranks are stalled",
    "nonfinite_update_applied": "the first applied step and its origin, which only the "
    "exporters hold; ampscope_nonfinite_updates_applied_total counts them",
}
"""Rules Prometheus lacks the data for, and what they would need."""

RANK_QUERIES = (
    "now",
    "state",
    "aligned_separate",
    "peak",
    "steps",
    "skipped",
    "inf_local",
    "inf_origin",
    "spikes",
    "skipped_nonfinite",
    "reruns",
    "gone",
    "replica_checks",
    *prometheus_fp8.FP8_QUERIES,
)
"""The queries whose every series is a rank's (run, rank and node labels), checked so."""

INSTANT = ("state", "other_state", "aligned_separate")
"""The queries that complete ``now``'s per-rank gauges (read with them, not per window)."""

SPIKE_DETAIL = (
    "counted from Prometheus (the growth of ampscope_spikes_total): the step, the value and the "
    "baseline are in each exporter's GET /api/v1/runs/{run}/health"
)
"""What a spike verdict computed from Prometheus says it lacks."""

SKIP_DETAIL = (
    "counted from Prometheus (the growth of ampscope_skipped_steps_total): the last skipped step "
    "and its origin ranks are in each exporter's GET /api/v1/runs/{run}/health"
)
"""What ``nonfinite_skipped`` computed from Prometheus says it lacks."""

RERUN_DETAIL = (
    "counted from Prometheus (ampscope_reruns_total, within the verdicts' window): the "
    "step, the device and the batch ids are in each exporter's GET /api/v1/runs/{run}/health"
)
"""What a rerun verdict computed from Prometheus says it lacks."""

REPLICA_DETAIL = (
    "counted from Prometheus (ampscope_replica_checks_total, since the rank process "
    "started): which rank disagrees, the step and the parameters are in each exporter's "
    "GET /api/v1/runs/{run}/health; the minority's device is the one "
    'ampscope_device_offences_total{{kind="replica_divergence"}} counts'
)
"""What ``replica_divergence`` computed from Prometheus says it lacks."""

COUNTED = {
    "replica_divergence": REPLICA_DETAIL,
    "transient_fault": RERUN_DETAIL,
    "reproducible_fault": RERUN_DETAIL,
    "loss_spike": SPIKE_DETAIL,
    "grad_norm_spike": SPIKE_DETAIL,
    "origin_outlier": SPIKE_DETAIL,
    "nonfinite_skipped": SKIP_DETAIL,
}
"""Rules Prometheus judges from counters alone, and where their details are."""


def _selector(run: str | None) -> str:
    # A JSON string is a valid PromQL string literal: quotes and backslashes escaped.
    return "" if run is None else f"run={json.dumps(run)}"


def peak_query(sel: str, window_s: float) -> str:
    """The scale ``scale_collapse`` measures a fall from, per rank, as the exporter and the
    alert ``AmpscopeScaleCollapse`` take it: the fault rule's clean scale
    (``ampscope_loss_scale_clean``; absent while a rank has none yet, so a warm-up from a high
    ``init_scale`` is no height to fall from); for a rank whose reporter predates the rule
    (no ``ampscope_faults_total``), its highest scale in the window. Whether a rank has the
    rule is read from one kind's series: the exporter exports every kind, 0 or not, for a
    rank whose reporter has the rule (the alert reads them all, to the same effect).

    Within the rank's current process only, as the exporter's window starts again at a new
    process: a rank restarted with the same run id keeps its labels, and a window holding
    the dead process's scale would read a resume at a lower scale as a fall. A reset of
    ``ampscope_steps_total`` (from zero in each process; no exporter restart resets it)
    within the window says the process changed; such a rank's reference is its current clean
    scale, the new process's own (a collapse right after the restart still shows its height),
    and an older reporter's rank has none (only the floor judges it until the restart has
    left the window)."""
    w = f"{window_s:g}s"
    ranks = "run, node, rank, local_rank"
    joined = f",{sel}" if sel else ""
    restarted = f"on ({ranks}) resets(ampscope_steps_total{{{sel}}}[{w}]) > 0"
    return (
        f"(max_over_time(ampscope_loss_scale_clean{{{sel}}}[{w}]) unless {restarted}) or "
        f"ampscope_loss_scale_clean{{{sel}}} * 1 or "
        f"(max_over_time(ampscope_loss_scale{{{sel}}}[{w}]) "
        f'unless on ({ranks}) ampscope_faults_total{{kind="{FAULT_KINDS[0]}"{joined}}} '
        f"unless {restarted})"
    )


WEATHER_MARK = "ampscope_weather_skipped_steps_total"
"""The family whose presence says a rank's reporter counts the loss scaler's weather."""


def counted_query(family: str, weather: str, sel: str, window_s: float) -> str:
    """The growth of ``family`` within the window (``grown_within``: no old count after a gap
    in the scrapes) without its part on iterations the fault rule called the loss scaler's
    weather (``weather``, the family of that part), as the recording rules count
    ``skip_storm`` and ``inf_hotspot``, never below 0 (a record's weather is at most its
    total, but one whose weather rose more than its total since the last is accepted); a
    rank whose reporter predates the weather count (no ``WEATHER_MARK``) counts all of it,
    as before.

    Reads ``family``'s window once: an old reporter's series subtract 0 (``family * 0``, its
    newest sample only), where ``clamp_min(counted - weather, 0) or (counted unless on (...)
    mark)`` read it in both branches, and VictoriaMetrics read the window twice (about a
    sixth more of its CPU at 8,192 ranks: docs/performance.md, "Whole job at scale"). The
    same series and values: ``or`` keeps a weather series where one matches, so a rank with
    the mark subtracts its weather, device by device; one without subtracts 0 from a growth
    that is never negative (the window holds the newest sample), which ``clamp_min`` leaves
    as it is; a rank with the mark and no weather series of that label set has nothing to
    subtract and is absent, in both forms."""
    counted = grown_within(f"{family}{{{sel}}}", window_s)
    weather_grown = grown_within(f"{weather}{{{sel}}}", window_s)
    ranks = "run, node, rank, local_rank"
    none = f"({family}{{{sel}}} * 0 unless on ({ranks}) {WEATHER_MARK}{{{sel}}})"
    return f"clamp_min({counted} - ({weather_grown} or {none}), 0)"


def steps_query(sel: str, window_s: float) -> str:
    """The steps ``skip_storm`` divides by, sent in the second round for the ranks the first
    found skipping within its window only (``sel`` narrowed to them): a rank that skipped
    none has ratio 0, which changes neither the rule's worst ratio (0 at least) nor its
    hits, so a job that skipped nothing sends no steps query at all."""
    return grown_within(f"ampscope_steps_total{{{sel}}}", window_s)


def queries(run: str | None, t: Thresholds) -> dict[str, str]:
    """The PromQL of the first round of one answer: name -> query. The windowed counts
    answer with the ranks that counted any (``> 0``; the diverged replica checks; the steps
    of the ranks that skipped any come in the second round, ``steps_query``): a rank without
    a series counts 0, which is what each rule reads for it, so a healthy job's windowed
    answers hold few series."""
    sel = _selector(run)
    names = "|".join(GAUGES)
    joined = f",{sel}" if sel else ""
    skipped = counted_query(
        "ampscope_skipped_steps_total", WEATHER_MARK, sel, t.skip_storm_window_s
    )
    return {
        "now": f'{{__name__=~"{names}"{joined}}}',
        "state": state_query(sel),
        "peak": peak_query(sel, t.collapse_window_s),
        "skipped": f"{skipped} > 0",
        "inf_local": counted_query(
            "ampscope_found_inf_total",
            "ampscope_weather_found_inf_total",
            sel,
            t.hotspot_window_s,
        ),
        "inf_origin": counted_query(
            "ampscope_found_inf_origin_total",
            "ampscope_weather_found_inf_origin_total",
            sel,
            t.hotspot_window_s,
        ),
        "spikes": grown_within(f"ampscope_spikes_total{{{sel}}}", t.spike_verdict_window_s)
        + " > 0",
        "skipped_nonfinite": grown_within(
            f"ampscope_skipped_steps_total{{{sel}}}", t.nonfinite_skipped_window_s
        )
        + " > 0",
        "reruns": counted_within("ampscope_reruns_total", sel, t.spike_verdict_window_s),
        "replica_checks": f'ampscope_replica_checks_total{{result="diverged"{joined}}} > 0',
        "gone": gone_query(sel),
        "up": up_query(sel),
        **prometheus_fp8.queries(sel, Fp8Rule()),
    }


NARROWED_MAX = 256
"""The most ranks a second-round query names (a regex of their numbers); beyond them it reads
the whole selection, a superset whose other ranks change nothing: they have no other state
at 1, skipped nothing (ratio 0), or hold the packed sample (the query's ``unless``)."""


def _narrowed(sel: str, keys: set[tuple[str, int]]) -> str:
    """``sel`` narrowed to the (run, rank) ``keys``, or ``sel`` itself beyond
    ``NARROWED_MAX`` of them."""
    return narrowed(sel, keys) if len(keys) <= NARROWED_MAX else sel


THRESHOLDS_QUERY = f"last_over_time(ampscope_exporter_health_threshold[{LOOKBACK_S}s])"
"""What every exporter heard from within the last hour publishes as its thresholds."""


def health_of(
    run: str,
    views: list[dict[str, Any]],
    windows: Mapping[str, Mapping[tuple[str, int], Mapping[str, float]]],
    t: Thresholds,
    now: float,
    down: Sequence[str] = (),
    fp8: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    gone: Collection[int] = (),
) -> dict[str, Any]:
    """The run's ``HealthReport`` dict, each verdict by the shared rule implementation;
    ``down``: the exporters of the run whose scrape fails, named by ``lost_rank``; ``fp8``:
    the answers of the FP8 queries (``prometheus_fp8.FP8_QUERIES``), whose verdicts the
    report holds when the run's ranks export FP8 series; ``gone``: the ranks of ``views``
    whose series are gone (``ranks.gone_ranks``), which ``stopped_rank`` leaves out as the
    exporters and ``AmpscopeRankStopped`` do (a stopped rank's series go
    ``--finished-retention`` after its goodbye)."""

    def window(name: str, view: Mapping[str, Any], device: str = "") -> float:
        # A second-round window that was not sent (no rank skipped: no steps) counts 0.
        return windows.get(name, {}).get((run, view["rank"]), {}).get(device, 0.0)

    facts = merge.facts_of(views)
    scale_facts = [
        scale.ScaleFacts(
            rank=v["rank"],
            node=v["node"],
            scaler=is_scaler(mode_of(v)),
            scale=v["scale"],
            window_peak_scale=max(v["scale"], window("peak", v)),
        )
        for v in views
    ]
    # A window's count never exceeds the counter (grown_within does not extrapolate); the
    # cap keeps it so for any form (a restart inside the window then undercounts, as the
    # exporter's restart rule does).
    steps = [
        nonfinite.StepFacts(
            rank=v["rank"],
            node=v["node"],
            steps=round(min(window("steps", v), v["totals"]["steps"])),
            skipped=round(min(window("skipped", v), v["totals"]["skipped_steps"])),
        )
        for v in views
    ]

    def detections(name: str, view: Mapping[str, Any], kind: str) -> dict[str, int]:
        held = view["totals"][kind]
        found = windows[name].get((run, view["rank"]), {})
        return {d: round(min(n, held.get(d, n))) for d, n in found.items()}

    infs = [
        nonfinite.InfFacts(
            rank=v["rank"],
            node=v["node"],
            local=detections("inf_local", v, "found_inf_local"),
            origin=detections("inf_origin", v, "found_inf_origin"),
        )
        for v in views
    ]

    def lacking(rule: str) -> dict[str, Any]:
        return {
            "rule": rule,
            "status": "ok",
            "summary": f"not evaluated from Prometheus: it needs {NEEDS_HISTORY[rule]}",
            "evidence": {"evaluated": False},
            "thresholds": {},
        }

    def spikes(kind: str) -> list[spike_rules.SpikeFacts]:
        # A counter that rose by n within the window's samples reads n (no extrapolation).
        counted = [(v, round(window("spikes", v, kind))) for v in views]
        return [
            spike_rules.SpikeFacts(rank=v["rank"], node=v["node"], spikes=n)
            for v, n in counted
            if n
        ]

    def reruns(result: str) -> list[rerun_rules.RerunFacts]:
        counted = [(v, round(window("reruns", v, result))) for v in views]
        return [
            rerun_rules.RerunFacts(rank=v["rank"], node=v["node"], reruns=n)
            for v, n in counted
            if n
        ]

    replicas = [
        replica_rules.ReplicaFacts(rank=v["rank"], node=v["node"], diverged=n)
        for v, n in ((v, round(window("replica_checks", v, "diverged"))) for v in views)
        if n
    ]

    skipped = [
        nonfinite.SkippedFacts(
            rank=v["rank"],
            node=v["node"],
            mode=mode_of(v),
            policy=v["setup"]["policy"],
            skipped=round(min(window("skipped_nonfinite", v), v["totals"]["skipped_steps"])),
        )
        for v in views
    ]

    def counted(verdict: Verdict) -> dict[str, Any]:
        out = verdict.model_dump()
        out["evidence"]["source"] = "prometheus"
        if out["status"] != "ok":
            out["summary"] += f" ({COUNTED[out['rule']].format(run=run)})"
        return out

    by_rule = {
        "scale_collapse": scale.scale_collapse(scale_facts, t).model_dump(),
        "skip_storm": nonfinite.skip_storm(steps, t).model_dump(),
        "scale_desync": scale.scale_desync(merge.aligned_of(views)).model_dump(),
        "lost_rank": _with_down(liveness.lost_rank(facts, t).model_dump(), down),
        "missing_rank": liveness.missing_rank(facts, judged=True).model_dump(),
        "stalled_rank": lacking("stalled_rank"),
        "stopped_rank": liveness.stopped_rank(
            [f for f in facts if f.rank not in gone], t, judged=True
        ).model_dump(),
        "rank_failed": failures.rank_failed(merge.failed_of(views), len(views)).model_dump(),
        "inf_hotspot": nonfinite.inf_hotspot(infs, t).model_dump(),
        "nonfinite_update_applied": lacking("nonfinite_update_applied"),
        "nonfinite_skipped": counted(nonfinite.nonfinite_skipped(skipped, t)),
        "loss_spike": counted(spike_rules.loss_spike(spikes("loss"), t)),
        "grad_norm_spike": counted(spike_rules.grad_norm_spike(spikes("grad_norm"), t)),
        "origin_outlier": counted(spike_rules.origin_outlier(spikes("origin_outlier"), t)),
        "transient_fault": counted(rerun_rules.transient_fault(reruns("transient"), t)),
        "reproducible_fault": counted(rerun_rules.reproducible_fault(reruns("reproducible"), t)),
        "replica_divergence": counted(replica_rules.replica_divergence(replicas, t)),
    }
    if fp8 is not None:
        by_rule.update(prometheus_fp8.verdicts(run, views, fp8, Fp8Rule()))
    verdicts = [by_rule[rule] for rule in in_report_order(by_rule)]
    up = sum(1 for v in views if v["up"])
    return health_report(run, verdicts, [f.state for f in facts], evaluated_at=now, up=up)


def _with_down(verdict: dict[str, Any], down: Sequence[str]) -> dict[str, Any]:
    """``lost_rank`` naming the exporters whose scrape fails (``up == 0``), when any does."""
    if down:
        verdict["evidence"]["exporters_down"] = list(down)
        if verdict["status"] != "ok":
            verdict["summary"] += "; scrape failing (up == 0): " + ", ".join(down)
    return verdict


def fetch(client: PrometheusClient, run: str | None, t: Thresholds | None = None) -> dict[str, Any]:
    """The answer in ``status --json``'s shape, from one time instant of Prometheus, with the
    thresholds it judged with (``thresholds``: their ``source``, ``exporters`` or
    ``defaults``, and values).

    Args:
        client: The query API.
        run: One run, or ``None`` for every run.
        t: The thresholds to judge with; ``None``: those the exporters publish.

    Raises:
        QueryError: a query failed; ``code`` 4 when ``run`` has no ranks there.
    """
    now = time.time()
    source = "given"
    if t is None:
        published = client.query(THRESHOLDS_QUERY, now)
        shapes.check_finite(published, f"{client.url}/api/v1/query (thresholds)")
        t, source = thresholds_of(published)
    asked = queries(run, t)
    with ThreadPoolExecutor(max_workers=len(asked)) as pool:
        futures = {name: pool.submit(client.query, promql, now) for name, promql in asked.items()}
        results = {name: future.result() for name, future in futures.items()}
    for name in RANK_QUERIES:
        # The labels every rank's series carries: a series without them is not ampscope's.
        where = f"{client.url}/api/v1/query ({name!r} query)"
        shapes.check_series(results.get(name, []), where)
    for name in asked:
        # Counts, steps and scales: NaN or 1e400 there is a malformed answer (FP8's own
        # queries read a NaN amax as what it is).
        if name not in prometheus_fp8.FP8_QUERIES:
            shapes.check_finite(results[name], f"{client.url}/api/v1/query ({name!r} query)")
    # Second round, only where the first found any: the state of the ranks not running, the
    # steps of the ranks that skipped (``skip_storm``'s ratio), the separate aligned series
    # of the scalers without the packed one (exporters that predate it), the families of the
    # gone ranks, and the ranks the failing exporters held (the hour's range reads), each
    # narrowed to those ranks.
    sel = _selector(run)
    follow = {}
    stopped = not_running(results["state"])
    if stopped:
        follow["other_state"] = other_state_query(_narrowed(sel, stopped))
    skipping = {(s["metric"]["run"], int(s["metric"]["rank"])) for s in results["skipped"]}
    if skipping:
        follow["steps"] = steps_query(_narrowed(sel, skipping), t.skip_storm_window_s)
    unpacked = without_packed(results["now"])
    if unpacked:
        follow["aligned_separate"] = separate_aligned_query(_narrowed(sel, unpacked))
    gone = {(s["metric"]["run"], int(s["metric"]["rank"])) for s in results["gone"]}
    if gone:
        follow["seen"] = seen_query(narrowed(sel, gone))
    down_now = {s["metric"].get("instance", "") for s in results["up"]}
    if down_now:
        follow["down_seen"] = down_seen_query(sel, down_now)
    if follow:
        with ThreadPoolExecutor(max_workers=len(follow)) as pool:
            futures = {name: pool.submit(client.query, q, now) for name, q in follow.items()}
            results.update({name: future.result() for name, future in futures.items()})
        for name in follow:
            where = f"{client.url}/api/v1/query ({name!r} query)"
            shapes.check_series(results[name], where)
            shapes.check_finite(results[name], where)
    aligned_separate = results.get("aligned_separate", [])
    states = results["state"] + results.get("other_state", [])
    views = build_views(results["now"] + states + aligned_separate, now)
    gone_views = gone_ranks(results.get("seen", []), views, now)
    views.update(gone_views)
    down = exporters_down(results["up"], results.get("down_seen", []))
    unwindowed = ("now", *INSTANT, "gone", "up", "seen", "down_seen", *prometheus_fp8.FP8_QUERIES)
    windowed = [name for name in (*asked, *follow) if name not in unwindowed]
    windows = {name: per_rank(results[name], views) for name in windowed}
    fp8 = {name: results[name] for name in prometheus_fp8.FP8_QUERIES}
    judged = {"source": source, **{f.name: getattr(t, f.name) for f in fields(t)}}
    by_run: dict[str, list[dict[str, Any]]] = {}
    for (name, _), view in sorted(views.items()):
        by_run.setdefault(name, []).append(view)

    def health(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        gone = {rank for held, rank in gone_views if held == name}
        return health_of(name, ranks, windows, t, now, down.get(name, ()), fp8, gone)

    if run is not None:
        if run not in by_run:
            raise QueryError(f"{client.url} holds no rank of run {run!r}", 4)
        ranks = by_run[run]
        return {
            "url": client.url,
            "run": run,
            "ranks": ranks,
            "health": health(run, ranks),
            "missing_ranks": merge.missing_of(ranks, judged=True),
            "thresholds": judged,
        }
    reports = {name: health(name, ranks) for name, ranks in by_run.items()}
    summaries = [
        {
            "run": name,
            "ranks": len(ranks),
            "up": sum(1 for v in ranks if v["up"]),
            "stale": sum(1 for v in ranks if not v["up"]),
            "states": reports[name]["states"],
            "world_size": max(ranks, key=lambda v: v["last_report_time"])["world_size"],
            "newest_step": max(v["step"] for v in ranks),
            "last_report_time": max(v["last_report_time"] for v in ranks),
        }
        for name, ranks in sorted(by_run.items())
    ]
    missing = {name: merge.missing_of(ranks, judged=True) for name, ranks in by_run.items()}
    return {
        "url": client.url,
        "runs": summaries,
        "ranks": by_run,
        "health": reports,
        "missing_ranks": missing,
        "thresholds": judged,
    }
