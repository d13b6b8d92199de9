"""What the demo prints: progress lines while it trains, then the exporter's view of each run.

Pure formatting over plain data (the trainer's ``Progress`` reports and the exporter's JSON),
so it is tested without training anything.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ampscope.demo.scenarios import Scenario
from ampscope.status.render import scale_text

_MARK = {"ok": "ok  ", "warning": "WARN", "critical": "CRIT"}
HISTORY_MARK = "hist"
"""A verdict a run that finished normally reads as history (``rollup.as_history``)."""


def _drawn(verdict: Mapping[str, Any]) -> bool:
    """Whether the run drew ``verdict``: it is not ok, or it is a finished run's history."""
    return verdict["status"] != "ok" or bool(verdict.get("evidence", {}).get("history"))


def ranks_text(scales: Sequence[float]) -> str:
    """Per-rank scales in rank order; condensed when there are many ranks."""
    if len(scales) <= 4:
        return " ".join(scale_text(s) for s in scales)
    if len(set(scales)) == 1:
        return f"{scale_text(scales[0])} (all {len(scales)})"
    return f"{scale_text(min(scales))}..{scale_text(max(scales))}"


def progress_lines(
    step: int, steps: int, scenarios: Sequence[Scenario], reports: Sequence[Any]
) -> list[str]:
    """One line per scenario for ``step``, from every rank's ``Progress`` report."""
    ordered = sorted(reports, key=lambda report: report.rank)
    head = f"step {step:>4}/{steps}"
    lines = []
    for index, scenario in enumerate(scenarios):
        scales = [report.scales[index] for report in ordered]
        skipped = max(report.skipped[index] for report in ordered)
        prefix = head if index == 0 else " " * len(head)
        line = f"{prefix}  {scenario.name:<9} scale {ranks_text(scales):<22} skipped {skipped:>3}"
        if len(set(scales)) > 1:
            line += "   <- ranks disagree"
        lines.append(line.rstrip())
    return lines


def _top_param(totals: Mapping[str, Any]) -> str:
    params = sorted(totals["nonfinite_params"], key=lambda p: p["count"], reverse=True)
    if not params:
        return "-"
    return f"{params[0]['name']} ({params[0]['count']})"


def rank_table(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The exporter's ``GET /api/v1/runs/{run}/ranks`` as a table, one row per rank."""
    header = (
        f"  {'rank':>4}  {'state':<8}  {'step':>5}  {'scale':>7}  {'skipped':>8}  {'backoffs':>8}  "
        f"{'growths':>7}  {'inf local':>9}  {'inf origin':>10}  top non-finite param"
    )
    rows = [header]
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        totals = rank["totals"]
        local = sum(totals["found_inf_local"].values())
        origin = sum(totals["found_inf_origin"].values())
        skipped = f"{totals['skipped_steps']}/{totals['steps']}"
        rows.append(
            f"  {rank['rank']:>4}  {rank.get('state', '?'):<8}  {rank['step']:>5}  "
            f"{scale_text(rank['scale']):>7}  "
            f"{skipped:>8}  {totals['backoffs']:>8}  {totals['growths']:>7}  {local:>9}  "
            f"{origin:>10}  {_top_param(totals)}"
        )
    return rows


def health_lines(health: Mapping[str, Any], expected: Sequence[str]) -> list[str]:
    """The exporter's verdicts for a run: the flagged ones in full, the rest in one line."""
    counts = health.get("states", {})
    states = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    lines = [f"  health: {health['status'].upper()}   ranks: {states or '-'}"]
    if health.get("state") == "finished":
        lines.append(
            "    every rank closed its scaler: the run finished, so no alert fires for it; "
            "the verdicts say how it ended, its spikes as history (hist: ok)"
        )
    quiet = []
    for verdict in health["verdicts"]:
        if not _drawn(verdict):
            quiet.append(verdict["rule"])
            continue
        mark = _MARK[verdict["status"]] if verdict["status"] != "ok" else HISTORY_MARK
        note = "  (expected)" if verdict["rule"] in expected else ""
        lines.append(f"    {mark} {verdict['rule']:<15} {verdict['summary']}{note}")
    if quiet:
        lines.append(f"    ok   {', '.join(quiet)}")
    return lines


def missing_verdicts(health: Mapping[str, Any], expected: Sequence[str]) -> list[str]:
    """Rules the scenario expects to fire that the exporter did not flag (a finished run's
    history counts: the demo reads its runs once they finished)."""
    flagged = {v["rule"] for v in health["verdicts"] if _drawn(v)}
    return [rule for rule in expected if rule not in flagged]


def ampscope_command() -> str:
    """How a shell runs this installation's ``ampscope``, as a command to print: ``ampscope``
    where that name on ``PATH`` is the script beside this interpreter, else the script's
    full path (a virtual environment that is not activated: ``.venv/bin/ampscope``), else
    ``python -m ampscope.cli`` with this interpreter's path."""
    script = Path(sys.executable).with_name("ampscope")  # not resolved: the venv's bin/
    if script.is_file():
        found = shutil.which("ampscope")
        if found is not None and Path(found).resolve() == script.resolve():
            return "ampscope"
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m ampscope.cli"


def where_to_look(
    base_url: str,
    run_ids: Sequence[str],
    hotspot_run: str | None,
    rerun_run: str | None = None,
    command: str = "ampscope",
) -> list[str]:
    """Links into the exporter, and PromQL to try once Prometheus scrapes it; with the run
    whose ranks rerun flagged iterations (``rerun_run``), the command that lists its suspect
    batches and the PromQL of its reruns. ``command``: how to run ampscope
    (``ampscope_command()``), so the commands work as printed."""
    example = hotspot_run or run_ids[0]
    suspects: list[str] = []
    reruns: list[str] = []
    if rerun_run is not None:
        suspects = [
            f"  suspects      {command} status --url {base_url} {rerun_run} --suspect-batches"
        ]
        reruns = [
            "    ampscope_reruns_total   # result: transient (its device), reproducible (data)"
        ]
    return [
        "Where to look",
        f"  web view      {base_url}/   (run page: {base_url}/run?id={example})",
        f"  terminal      {command} status --url {base_url} {example}",
        *suspects,
        f"  metrics       {base_url}/metrics",
        f"  API docs      {base_url}/docs",
        f"  runs          {base_url}/api/v1/runs",
        f"  health        {base_url}/api/v1/runs/{example}/health",
        f"  ranks         {base_url}/api/v1/runs/{example}/ranks",
        f"  history       {base_url}/api/v1/runs/{example}/ranks/0/history?limit=20",
        "  PromQL, with Prometheus scraping the exporter (deploy/prometheus/prometheus.yml):",
        f'    ampscope_loss_scale{{run="{example}"}}',
        f'    ampscope_rank_state{{run="{example}"}} == 1   # running, stalled, lost, ..., stopped',
        "    ampscope_run:loss_scale:max_over_min   # ranks compared at the same step",
        "    increase(ampscope_found_inf_origin_total[5m])",
        "    topk(5, ampscope_nonfinite_grads_total)",
        "    increase(ampscope_spikes_total[5m])   # kind: loss, grad_norm, origin_outlier",
        *reruns,
    ]


def keep_serving_hint(command: str, argv: Sequence[str]) -> list[str]:
    """What the demo prints instead of links once its exporter has stopped: how to run it
    again so that the exporter keeps serving (``argv``: the demo's options, as given)."""
    again = shlex.join([*argv, "--keep-serving"])
    return [
        "The exporter has stopped with the demo, so it prints no links (none would answer).",
        "To keep it serving until Ctrl-C, with the web view, `ampscope status`, the API,",
        "/metrics for Prometheus and Grafana, and the links, run the demo with --keep-serving:",
        f"  {command} demo {again}".rstrip(),
    ]
