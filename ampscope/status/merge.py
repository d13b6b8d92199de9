"""One whole-job answer from several exporters' answers (one exporter per node).

Pure functions over the JSON API's plain data, in the shape ``ampscope status --json``
prints for one exporter, so a script written for one works for the other. Ranks are
concatenated (a rank held by two exporters, after a restart onto another node, counts once:
its most recently heard copy). The verdicts that need the whole job are computed again over
the merged ranks by the rules the exporter runs (``ampscope.verdicts``): ``lost_rank`` (its
critical share is of the whole job), ``missing_rank``, ``stopped_rank`` (whether a stopped
rank's id came back on another node, and whether its world goes on there), ``rank_failed``
(every node's failed ranks, their origins joined), ``scale_desync`` (every node's aligned
scales: a desync between nodes shows only there) and ``stalled_rank``'s ok summary (the live
ranks of every node; a stalled rank keeps its exporter's verdict, which holds its progress
times). The FP8
rules (``fp8_amax_spike``, ``fp8_underflow``, ``fp8_nonfinite_amax``) list every
exporter's flagged series (each exporter judged its own ranks' layers), counted together;
present when any exporter has FP8 layers for the run. The other rules are per-rank facts
each exporter already judged over its own ranks: the merge keeps the worst exporter's
verdict and lists every exporter that flagged it under ``evidence["exporters"]``. Costs
O(ranks + world size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampscope.verdicts import failures, liveness, scale
from ampscope.verdicts import fp8 as fp8_rules
from ampscope.verdicts.ranks import RankFacts, is_scaler, mode_of, paused_of, reported_state
from ampscope.verdicts.rollup import health_report
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import FP8_RULES, SEVERITY, Verdict, in_report_order


def facts_of(views: Sequence[Mapping[str, Any]]) -> list[RankFacts]:
    """The shared rules' view of ranks from ``/api/v1/runs/{run}/ranks`` entries."""
    return [
        RankFacts(
            rank=view["rank"],
            node=view["node"],
            state=reported_state(view.get("state"), view.get("up")),
            world_size=view["world_size"],
            local_world_size=view.get("local_world_size"),
            last_step=view["step"],
            last_report_time=view["last_report_time"],
            seconds_since_report=view["seconds_since_report"],
            step_time=view.get("step_time"),
            pause=paused_of(view),
        )
        for view in views
    ]


def failed_of(views: Sequence[Mapping[str, Any]]) -> list[failures.FailedFacts]:
    """``rank_failed``'s facts: the failed ranks and what their ``failure`` says (a view from
    Prometheus has no message)."""
    facts = []
    for view in views:
        failure = view.get("failure")
        if view.get("state") != "failed" or not isinstance(failure, Mapping):
            continue
        origin = failure.get("origin_ranks")
        facts.append(
            failures.FailedFacts(
                rank=view["rank"],
                node=view["node"],
                kind=failure.get("kind", "exception"),
                exception=failure.get("exception", "unknown"),
                message=failure.get("message"),
                step=failure.get("step", view["step"]),
                origin_ranks=None if origin is None else tuple(origin),
            )
        )
    return facts


def aligned_of(views: Sequence[Mapping[str, Any]]) -> list[scale.AlignedFacts]:
    """``scale_desync``'s view of ranks: whether each runs a scaler, and its aligned scale."""
    facts = []
    for view in views:
        aligned = (view.get("totals") or {}).get("aligned_scale") or {}
        facts.append(
            scale.AlignedFacts(
                rank=view["rank"],
                node=view["node"],
                scaler=is_scaler(mode_of(view)),
                step=aligned.get("step"),
                scale=aligned.get("scale"),
            )
        )
    return facts


def merge_ranks(per_target: Sequence[Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """Every target's ranks, one entry per rank (its most recently heard), by rank."""
    newest: dict[int, Mapping[str, Any]] = {}
    for views in per_target:
        for view in views:
            held = newest.get(view["rank"])
            if held is None or view["last_report_time"] > held["last_report_time"]:
                newest[view["rank"]] = view
    return [newest[rank] for rank in sorted(newest)]


def missing_of(views: Sequence[Mapping[str, Any]], *, judged: bool) -> list[int]:
    """The top-level ``missing_ranks``: every rank the world size says exists but no
    exporter holds; empty when ``judged`` is false (one node's exporter of a larger job)."""
    facts = facts_of(views)
    return liveness.missing_ranks(facts) if judged or liveness.whole_job(facts) else []


def _thresholds(reports: Sequence[Mapping[str, Any]]) -> Thresholds:
    """The exporters' thresholds, read back from their own verdicts; the defaults where
    none reports one, or where what they report does not hold together."""
    try:
        return Thresholds.read_back(v for report in reports for v in report["verdicts"])
    except (TypeError, ValueError):
        return Thresholds()


def _worst_of(rule: str, reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The worst exporter's verdict for ``rule``, naming every exporter that flagged it."""
    found = [
        (url, verdict)
        for url, report in reports
        for verdict in report["verdicts"]
        if verdict["rule"] == rule
    ]
    # Among equals a finished run's history (``rollup.as_history``) before a plain ok.
    _, worst = max(
        found,
        key=lambda item: (SEVERITY[item[1]["status"]], bool(item[1]["evidence"].get("history"))),
    )
    merged = dict(worst)
    flagged = [
        {"url": url, "status": verdict["status"], "summary": verdict["summary"]}
        for url, verdict in found
        if verdict["status"] != "ok" or verdict["evidence"].get("history")
    ]
    if flagged:
        merged["evidence"] = {**worst["evidence"], "exporters": flagged}
        if len(flagged) > 1:
            merged["summary"] = f"{worst['summary']} (and {len(flagged) - 1} more exporter(s))"
    return merged


def _fp8_merged(rule: str, reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """An FP8 rule's verdict over every exporter's: their flagged series together (in the
    rule's order: newest spike step, highest ratio, earliest non-finite step), naming every
    exporter that flagged it."""
    found = [
        (url, verdict)
        for url, report in reports
        for verdict in report["verdicts"]
        if verdict["rule"] == rule
    ]
    flagged = [(url, v) for url, v in found if v["status"] != "ok"]
    listed = [entry for _, v in flagged for entry in v["evidence"].get("series", [])]
    affected = sum(v["evidence"].get("series_affected", 0) for _, v in flagged)
    # An ok verdict counts the series it judged; a flagged one, only those it flagged.
    judged = sum(v["evidence"].get("series", 0) for _, v in found if v["status"] == "ok")
    thresholds = found[0][1].get("thresholds") or {}
    merged: Verdict
    if rule == "fp8_amax_spike":
        listed.sort(key=lambda e: -(e.get("step") or 0))
        merged = fp8_rules.spike_verdict(listed, affected, judged + affected, thresholds)
    elif rule == "fp8_underflow":
        listed.sort(key=lambda e: -e["ratio"])
        worst = max(
            [e["ratio"] for e in listed]
            + [v["evidence"].get("worst_ratio", 0.0) for _, v in found if v["status"] == "ok"],
            default=0.0,
        )
        merged = fp8_rules.underflow_verdict(listed, affected, judged + affected, worst, thresholds)
    else:
        listed.sort(key=lambda e: (e.get("step") is None, e.get("step") or 0, e["rank"]))
        merged = fp8_rules.nonfinite_verdict(listed, affected, judged + affected, thresholds)
    out = merged.model_dump()
    if flagged:
        out["evidence"]["exporters"] = [
            {"url": url, "status": v["status"], "summary": v["summary"]} for url, v in flagged
        ]
    return out


def _replica_merged(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """``replica_divergence`` over every exporter's: the flagged verdict of the earliest
    step, preferring the one that names the most devices (the exporter of the minority's
    node knows its device), naming every exporter that flagged it."""
    merged = _worst_of("replica_divergence", reports)
    found = [
        v
        for _, report in reports
        for v in report["verdicts"]
        if v["rule"] == "replica_divergence" and v["status"] != "ok"
    ]
    if not found:
        return merged

    def rank(v: Mapping[str, Any]) -> tuple[int, int]:
        evidence = v["evidence"]
        named = sum("device" in e for e in evidence.get("ranks", []))
        return (evidence.get("step", 2**62), -named)

    best = min(found, key=rank)
    evidence = {**merged["evidence"], **best["evidence"]}
    return {**merged, "summary": best["summary"], "evidence": evidence}


def merge_health(
    run: str,
    reports: Sequence[tuple[str, Mapping[str, Any]]],
    views: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """One ``HealthReport`` for ``run`` from (url, report) pairs and the merged ranks."""
    facts = facts_of(views)
    thresholds = _thresholds([report for _, report in reports])
    recomputed = {
        "lost_rank": liveness.lost_rank(facts, thresholds).model_dump(),
        "missing_rank": liveness.missing_rank(facts, judged=True).model_dump(),
        "stopped_rank": liveness.stopped_rank(facts, thresholds, judged=True).model_dump(),
        "scale_desync": scale.scale_desync(aligned_of(views)).model_dump(),
        "rank_failed": failures.rank_failed(failed_of(views), len(views)).model_dump(),
    }
    given = [v["rule"] for _, report in reports for v in report["verdicts"]]
    recomputed.update({rule: _fp8_merged(rule, reports) for rule in FP8_RULES if rule in given})
    if "replica_divergence" in given:
        recomputed["replica_divergence"] = _replica_merged(reports)
    verdicts = [
        recomputed.get(rule) or _worst_of(rule, reports)
        for rule in in_report_order([*given, *recomputed])
    ]
    stalled = liveness.stalled_rank(facts, thresholds).model_dump()
    verdicts = [
        # Every node progresses: say so of the whole job, not of the first node.
        stalled if v["rule"] == "stalled_rank" and v["status"] == "ok" else v
        for v in verdicts
    ]
    return health_report(
        run,
        verdicts,
        [f.state for f in facts],
        evaluated_at=max(report["evaluated_at"] for _, report in reports),
        up=sum(1 for view in views if view.get("up")),
    )


def merge_summaries(per_target: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """``GET /api/v1/runs`` of every target as one list: counts summed, the newest step
    and report the highest, the world size the most recently reporting target's."""
    merged: dict[str, dict[str, Any]] = {}
    for summaries in per_target:
        for summary in summaries:
            held = merged.get(summary["run"])
            if held is None:
                merged[summary["run"]] = {**summary, "states": dict(summary["states"])}
                continue
            for key in ("ranks", "up", "stale"):
                held[key] += summary[key]
            for state, count in summary["states"].items():
                held["states"][state] = held["states"].get(state, 0) + count
            held["newest_step"] = max(held["newest_step"], summary["newest_step"])
            if summary["last_report_time"] > held["last_report_time"]:
                held["last_report_time"] = summary["last_report_time"]
                held["world_size"] = summary["world_size"]
    return [merged[run] for run in sorted(merged)]
