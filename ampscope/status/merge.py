"""One whole-job answer from several exporters' answers (one exporter per node).

Pure functions over the JSON API's plain data, in the shape ``ampscope status --json``
prints for one exporter, so a script written for one works for the other. Ranks are
concatenated (a rank held by two exporters, after a restart onto another node, counts once:
its most recently heard copy). The verdicts that need the whole job are computed again over
the merged ranks by the same rule implementations the exporter runs
(``ampscope.verdicts.rules``): ``lost_rank`` (its critical share is of the whole job),
``missing_rank`` and ``rank_failed`` (every node's failed ranks, their origins joined),
``stalled_rank``'s ok summary (the live ranks of every node), and a
``scale_desync`` across nodes at the ranks' aligned steps (``rules.aligned_scale_desync``),
which replaces the exporters' own when it is worse. The other rules are per-rank facts
each exporter already judged over its own ranks: the merge keeps the worst exporter's
verdict and lists every exporter that flagged it under ``evidence["exporters"]``. Costs
O(ranks + world size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampscope.verdicts import failures, rules
from ampscope.verdicts.rules import RankFacts, Thresholds

SEVERITY = {"ok": 0, "warning": 1, "critical": 2}
STATES = ("running", "stalled", "lost", "finished", "failed")
ENDED = ("finished", "failed")
"""States of a rank that said goodbye: a run whose ranks are all in them ended."""


def facts_of(views: Sequence[Mapping[str, Any]]) -> list[RankFacts]:
    """The shared rules' view of ranks from ``/api/v1/runs/{run}/ranks`` entries."""
    return [
        RankFacts(
            rank=view["rank"],
            node=view["node"],
            state=view.get("state") or ("running" if view.get("up") else "lost"),
            world_size=view["world_size"],
            local_world_size=view.get("local_world_size"),
            last_step=view["step"],
            last_report_time=view["last_report_time"],
            seconds_since_report=view["seconds_since_report"],
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


def run_state(states: Mapping[str, int], ranks: int) -> str:
    """A run's ``state``: ``failed`` or ``finished`` once every rank ended, else ``active``."""
    if not ranks or sum(states.get(name, 0) for name in ENDED) != ranks:
        return "active"
    return "failed" if states.get("failed") else "finished"


def aligned_of(views: Sequence[Mapping[str, Any]]) -> tuple[list[rules.AlignedFacts], int]:
    """The aligned scales of the scaler ranks, and how many ranks run a scaler."""
    scalers = [v for v in views if (v.get("setup") or {}).get("mode", "scaler") == "scaler"]
    facts = [
        rules.AlignedFacts(
            rank=v["rank"], node=v["node"], step=aligned["step"], scale=aligned["scale"]
        )
        for v in scalers
        if (aligned := (v.get("totals") or {}).get("aligned_scale"))
        and "step" in aligned
        and "scale" in aligned
    ]
    return facts, len(scalers)


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
    return rules.missing_ranks(facts) if judged or rules.whole_job(facts) else []


def _thresholds(reports: Sequence[Mapping[str, Any]]) -> Thresholds:
    """The exporters' lost-rank thresholds, read back from their own verdicts."""
    for report in reports:
        for verdict in report["verdicts"]:
            if verdict["rule"] == "lost_rank" and verdict.get("thresholds"):
                given = verdict["thresholds"]
                return Thresholds(
                    stale_after_s=float(given.get("stale_after_s", 60.0)),
                    lost_critical_share=float(given.get("critical_share", 0.25)),
                )
    return Thresholds()


def _worst_of(rule: str, reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The worst exporter's verdict for ``rule``, naming every exporter that flagged it."""
    found = [
        (url, verdict)
        for url, report in reports
        for verdict in report["verdicts"]
        if verdict["rule"] == rule
    ]
    _, worst = max(found, key=lambda item: SEVERITY[item[1]["status"]])
    merged = dict(worst)
    flagged = [
        {"url": url, "status": verdict["status"], "summary": verdict["summary"]}
        for url, verdict in found
        if verdict["status"] != "ok"
    ]
    if flagged:
        merged["evidence"] = {**worst["evidence"], "exporters": flagged}
        if len(flagged) > 1:
            merged["summary"] = f"{worst['summary']} (and {len(flagged) - 1} more exporter(s))"
    return merged


def merge_health(
    run: str,
    reports: Sequence[tuple[str, Mapping[str, Any]]],
    views: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """One ``HealthReport`` for ``run`` from (url, report) pairs and the merged ranks."""
    facts = facts_of(views)
    thresholds = _thresholds([report for _, report in reports])
    recomputed = {
        "lost_rank": rules.lost_rank(facts, thresholds).model_dump(),
        "missing_rank": rules.missing_rank(facts, judged=True).model_dump(),
        "rank_failed": failures.rank_failed(failed_of(views), len(views)).model_dump(),
    }
    order: list[str] = []
    for _, report in reports:
        order += [v["rule"] for v in report["verdicts"] if v["rule"] not in order]
    for rule in recomputed:
        if rule not in order:  # exporters that predate the rule
            order.append(rule)
    verdicts = [recomputed.get(rule) or _worst_of(rule, reports) for rule in order]
    # Each exporter compared its own node's ranks step by step; the aligned scales compare
    # every node's: a desync between nodes shows only there.
    across = rules.aligned_scale_desync(*aligned_of(views)).model_dump()
    verdicts = [
        across
        if v["rule"] == "scale_desync" and SEVERITY[across["status"]] > SEVERITY[v["status"]]
        else v
        for v in verdicts
    ]
    states = {name: sum(1 for f in facts if f.state == name) for name in STATES}
    for verdict in verdicts:
        if verdict["rule"] == "stalled_rank" and verdict["status"] == "ok":
            # Every node progresses: say so of the whole job, not of the first node.
            live = states["running"] + states["stalled"]
            verdict["summary"] = rules.progress_summary(live, [f.state for f in facts])
            verdict["evidence"] = {"stalled": 0, "live": live}
    return {
        "run": run,
        "status": max((v["status"] for v in verdicts), key=SEVERITY.__getitem__, default="ok"),
        "state": run_state(states, len(facts)),
        "evaluated_at": max(report["evaluated_at"] for _, report in reports),
        "ranks": len(views),
        "up": sum(1 for view in views if view.get("up")),
        "states": states,
        "verdicts": verdicts,
    }


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
