"""Tables of the exporter's JSON for ``ampscope status``: pure functions over plain data."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ampscope.verdicts.fp8 import MAX_EVIDENCE_SERIES
from ampscope.verdicts.ranks import is_scaler, mode_of, paused_of, reported_state
from ampscope.verdicts.verdict import FP8_RULES, SEVERITY

FAILED_TARGETS = "exporters without a usable answer:"
"""Heads the targets that did not answer, or answered something of the wrong shape."""

_MARK = {"ok": "ok", "warning": "WARN", "critical": "CRIT"}


def scale_text(scale: float) -> str:
    """A loss scale as ``2^k`` when it is a power of two (they nearly always are)."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent.is_integer():
            return f"2^{int(exponent)}"
    return f"{scale:g}"


def is_watch(view: Mapping[str, Any]) -> bool:
    """Whether the rank runs a watch (bf16/fp32, no loss scale) rather than a scaler."""
    return not is_scaler(mode_of(view))


def mode_text(view: Mapping[str, Any]) -> str:
    """``scaler``, or ``watch/observe`` (a watch's policy decides what a bad step does)."""
    return "scaler" if not is_watch(view) else f"watch/{view['setup']['policy']}"


def setup_line(views: Sequence[Mapping[str, Any]]) -> str:
    """What a run's ranks run, in words: ``no loss scale: bfloat16 watch, policy observe``."""
    described = []
    for view in views:
        dtype = (view.get("setup") or {}).get("grad_dtype") or "unknown dtype"
        if is_watch(view):
            text = f"no loss scale: {dtype} watch, policy {view['setup']['policy']}"
        else:
            # A scaler's gradients are often float32 (autocast keeps fp32 parameters).
            text = "loss scaler" if dtype == "unknown dtype" else f"loss scaler, {dtype} gradients"
        if text not in described:
            described.append(text)
    return "; ".join(described)


def rank_state(rank: Mapping[str, Any]) -> str:
    """The rank's lifecycle state as the API gives it, as the rules read it (an older
    exporter's rank that says only up or not: ``running`` or ``lost``)."""
    return reported_state(rank.get("state"), rank.get("up"))


def state_cell(rank: Mapping[str, Any]) -> str:
    """The rank's state as a table shows it: ``running, paused (checkpoint) for 700 s``
    for a rank that says it paused on purpose."""
    pause = paused_of(rank)
    state = rank_state(rank)
    return state if pause is None else f"{state}, {pause.text()}"


def states_text(ranks: Sequence[Mapping[str, Any]]) -> str:
    """``2 running, 1 lost``: ranks counted by state, in order of first appearance."""
    counts: dict[str, int] = {}
    for rank in ranks:
        state = rank_state(rank)
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


FAILURE_MESSAGE = 160
"""Characters of a failed rank's message a table line quotes (``--json`` holds it whole)."""


def failure_lines(views: Sequence[Mapping[str, Any]]) -> list[str]:
    """``failed ranks:`` and one line per failed rank: its exception, step and message (from
    Prometheus, no message); empty when no rank failed."""
    lines = []
    for view in sorted(views, key=lambda v: v["rank"]):
        failure = view.get("failure")
        if rank_state(view) != "failed" or not isinstance(failure, Mapping):
            continue
        nonfinite = failure.get("kind") == "nonfinite_gradients"
        when = "at" if nonfinite else "after"
        line = (
            f"  rank {view['rank']} (node {view['node']}): {failure.get('exception')} {when} "
            f"step {failure.get('step')}"
        )
        message = " ".join(str(failure.get("message") or "").split())
        if message:
            cut = message[: FAILURE_MESSAGE - 1] + "…"
            line += ": " + (message if len(message) <= FAILURE_MESSAGE else cut)
        lines.append(line)
    return ["", "failed ranks:", *lines] if lines else []


def _fp8_detail(rule: str, entry: Mapping[str, Any]) -> str:
    if rule == "fp8_amax_spike":
        return (
            f"amax {entry['value']:.4g}, {entry['factor']:.0f}x its median {entry['baseline']:.4g}"
        )
    if rule == "fp8_underflow":
        return f"{entry['ratio']:.0%} of non-zero values underflow"
    return "amax inf or NaN"


def fp8_lines(health: Mapping[str, Any]) -> list[str]:
    """``FP8 series flagged:`` and a line per series an FP8 verdict flags (rank, node, layer,
    tensor, step, what happened), the critical rule first; empty when none is flagged."""
    rows = []
    more = 0
    flagged = [v for v in health["verdicts"] if v["rule"] in FP8_RULES and v["status"] != "ok"]
    for verdict in sorted(flagged, key=lambda v: -SEVERITY[v["status"]]):
        listed = verdict["evidence"].get("series", [])
        more += verdict["evidence"].get("series_affected", len(listed)) - len(listed)
        for entry in listed:
            step = entry.get("step")
            rows.append(
                [
                    _MARK[verdict["status"]],
                    verdict["rule"],
                    str(entry["rank"]),
                    entry["node"],
                    entry["layer"],
                    entry["tensor"],
                    "-" if step is None else str(step),
                    _fp8_detail(verdict["rule"], entry),
                ]
            )
    if not rows:
        return []
    header = ["", "RULE", "RANK", "NODE", "LAYER", "TENSOR", "STEP", "WHAT"]
    lines = ["", "FP8 series flagged:", *_table(header, rows, right={2, 6})]
    if more:
        per = f"a verdict lists at most {MAX_EVIDENCE_SERIES} per exporter"
        lines.append(f"  … and {more} more series ({per})")
    return lines


def _found_inf(ranks: Sequence[Mapping[str, Any]], kind: str) -> int:
    return sum(sum(rank["totals"][kind].values()) for rank in ranks)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(cell).rjust(width) if i in right else str(cell).ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(row) for row in rows)]


def flagged_lines(health: Mapping[str, Any], indent: str = "  ") -> list[str]:
    """One line per verdict that is not ok: its mark, rule and summary."""
    return _verdict_lines([v for v in health["verdicts"] if v["status"] != "ok"], indent)


def _verdict_lines(verdicts: Sequence[Mapping[str, Any]], indent: str = "  ") -> list[str]:
    width = max((len(v["rule"]) for v in verdicts), default=0)
    return [
        f"{indent}{_MARK[v['status']]:<4} {v['rule']:<{width}}  {v['summary']}" for v in verdicts
    ]


def _scales_text(views: Sequence[Mapping[str, Any]]) -> str:
    """The range of the scalers' scales; ``none`` when every rank runs a watch."""
    scales = [view["scale"] for view in views if not is_watch(view)]
    if not scales:
        return "none"
    low, high = min(scales), max(scales)
    return scale_text(low) if low == high else f"{scale_text(low)}..{scale_text(high)}"


def runs_table(
    summaries: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, Sequence[Mapping[str, Any]]],
    health: Mapping[str, Mapping[str, Any]],
) -> list[str]:
    """Every run on one line (``GET /api/v1/runs`` with each run's ranks and health), then
    the flagged verdicts of each run."""
    if not summaries:
        return ["no runs: no rank has reported to this exporter yet"]
    header = ["RUN", "HEALTH", "UP", "STATES", "STEP", "MODE", "SCALE", "SKIPPED", "INF L/O"]
    header.append("FLAGGED")
    rows = []
    notes: list[str] = []
    for summary in summaries:
        run = summary["run"]
        views, report = ranks[run], health[run]
        modes = ",".join(dict.fromkeys(mode_text(view) for view in views))
        flagged = [v["rule"] for v in report["verdicts"] if v["status"] != "ok"]
        rows.append(
            [
                run,
                report["status"].upper(),
                f"{summary['up']}/{summary['ranks']}",
                states_text(views),
                str(summary["newest_step"]),
                modes,
                _scales_text(views),
                str(max((view["totals"]["skipped_steps"] for view in views), default=0)),
                f"{_found_inf(views, 'found_inf_local')}/{_found_inf(views, 'found_inf_origin')}",
                ",".join(flagged) or "-",
            ]
        )
        if flagged:
            notes += [f"{run}:", *flagged_lines(report)]
    return _table(header, rows, right={4, 7, 8}) + (["", *notes] if notes else [])


def run_table(run: str, views: Sequence[Mapping[str, Any]], health: Mapping[str, Any]) -> list[str]:
    """One run: a line per rank (``GET /api/v1/runs/{run}/ranks``), then every verdict."""
    header = ["RANK", "NODE", "STATE", "STEP", "MODE", "SCALE", "SKIPPED", "BACKOFFS"]
    header += ["INF LOCAL", "INF ORIGIN", "INF APPLIED", "LAST REPORT"]
    rows = []
    for view in sorted(views, key=lambda v: v["rank"]):
        totals = view["totals"]
        watch = is_watch(view)
        rows.append(
            [
                str(view["rank"]),
                view["node"],
                state_cell(view),
                str(view["step"]),
                mode_text(view),
                # A watch's records say scale 1 and no backoffs: not a loss scale at all.
                "none" if watch else scale_text(view["scale"]),
                f"{totals['skipped_steps']}/{totals['steps']}",
                "-" if watch else str(totals["backoffs"]),
                str(sum(totals["found_inf_local"].values())),
                str(sum(totals["found_inf_origin"].values())),
                str(totals.get("nonfinite_applied", 0)),
                f"{view['seconds_since_report']:.0f}s ago",
            ]
        )
    head = (
        f"run {run}: {health['status'].upper()}, {health['up']}/{health['ranks']} rank(s) up "
        f"({states_text(views)}); {setup_line(views)}"
    )
    table = _table(header, rows, right={0, 3, 6, 7, 8, 9, 10, 11})
    failed = failure_lines(views)
    verdicts = _verdict_lines(health["verdicts"])
    return [head, "", *table, *failed, *fp8_lines(health), "", "health:", *verdicts]


def _named(value: Any, key: str, into: set[Any]) -> None:
    """Every ``key`` of the dicts nested in ``value`` (a verdict's evidence)."""
    if isinstance(value, Mapping):
        if key in value and isinstance(value[key], (int, str)):
            into.add(value[key])
        for item in value.values():
            _named(item, key, into)
    elif isinstance(value, list):
        for item in value:
            _named(item, key, into)


def named_in(verdict: Mapping[str, Any], key: str) -> set[Any]:
    """The ranks (``key="rank"``) or nodes (``"node"``) a verdict's evidence names."""
    found: set[Any] = set()
    _named(verdict["evidence"], key, found)
    return found


def _steps_text(views: Sequence[Mapping[str, Any]]) -> str:
    low, high = min(v["step"] for v in views), max(v["step"] for v in views)
    return str(low) if low == high else f"{low}..{high}"


def target_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per target without a usable answer (a target without the run is no
    failure)."""
    return [
        f"  {t['status']:<11}  {t['url']}: {t['error']}"
        for t in targets
        if t["status"] not in ("ok", "no_such_run")
    ]


def job_table(
    run: str,
    views: Sequence[Mapping[str, Any]],
    health: Mapping[str, Any],
    missing: Sequence[int],
    targets: Sequence[Mapping[str, Any]],
    source: str | None = None,
) -> list[str]:
    """One run over every node's exporter (or from ``source``, e.g. Prometheus): a line per
    node (ranks, states, steps, worst verdict naming it), then the outlier ranks (named by
    a flagged verdict, or neither running nor ended by saying goodbye normally: finished,
    or stopped by its launcher), then every verdict and the targets without a usable
    answer."""
    flagged = [v for v in health["verdicts"] if v["status"] != "ok"]
    nodes: dict[str, list[Mapping[str, Any]]] = {}
    for view in views:
        nodes.setdefault(view["node"], []).append(view)
    rows = []
    for node in sorted(nodes):
        worst = max(
            (v["status"] for v in flagged if node in named_in(v, "node")),
            key=SEVERITY.__getitem__,
            default="ok",
        )
        members = nodes[node]
        rows.append(
            [node, str(len(members)), states_text(members), _steps_text(members), worst.upper()]
        )
    answered = sum(1 for t in targets if t["status"] in ("ok", "no_such_run"))
    world = max((v["world_size"] for v in views), default=0)
    head = (
        f"run {run}: {health['status'].upper()}, {health['up']}/{health['ranks']} rank(s) up "
        f"({states_text(views)}) of world size {world} on {len(nodes)} node(s); "
        + (source or f"{answered}/{len(targets)} exporter(s) answered")
    )
    lines = [head]
    if views:
        lines[0] += f"; {setup_line(views)}"
    if missing:
        shown = ", ".join(map(str, missing[:32])) + (" …" if len(missing) > 32 else "")
        lines.append(f"missing ranks ({len(missing)}): {shown}")
    lines += ["", *_table(["NODE", "RANKS", "STATES", "STEP", "HEALTH"], rows, right={1})]
    rules_of: dict[int, list[str]] = {}
    for verdict in flagged:
        for rank in named_in(verdict, "rank"):
            rules_of.setdefault(rank, []).append(verdict["rule"])
    outliers = [
        view
        for view in views
        if view["rank"] in rules_of or rank_state(view) not in ("running", "finished", "stopped")
    ]
    if outliers:
        header = ["RANK", "NODE", "STATE", "STEP", "SCALE", "SKIPPED", "INF L/O", "FLAGGED"]
        outlier_rows = [
            [
                str(view["rank"]),
                view["node"],
                state_cell(view),
                str(view["step"]),
                "none" if is_watch(view) else scale_text(view["scale"]),
                f"{view['totals']['skipped_steps']}/{view['totals']['steps']}",
                f"{sum(view['totals']['found_inf_local'].values())}/"
                f"{sum(view['totals']['found_inf_origin'].values())}",
                ",".join(rules_of.get(view["rank"], [])) or "-",
            ]
            for view in outliers
        ]
        lines += ["", "outlier ranks:", *_table(header, outlier_rows, right={0, 3, 5, 6})]
    lines += failure_lines(views)
    lines += fp8_lines(health)
    lines += ["", "health:", *_verdict_lines(health["verdicts"])]
    failed = target_lines(targets)
    return lines + (["", FAILED_TARGETS, *failed] if failed else [])
