"""Readers for the deployment files the deploy tests check: dashboards and Prometheus rules.

Also a small PromQL scanner that pulls metric names out of an expression, so the tests can
hold every name used anywhere against the metric catalogue.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "dashboards"
# Writes dashboards/ampscope.json (to standard output without --write).
DASHBOARD_GENERATOR = DASHBOARD_DIR / "src" / "ampscope_dashboard.py"
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES_FILE = PROMETHEUS_DIR / "rules" / "ampscope-alerts.yml"

# Values the e2e test gives Grafana's variables: every run/node/rank, short windows.
TEMPLATE_VALUES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$run": ".*",
    "$node": ".*",
    "$rank": ".*",
    "$fp8_rank": ".*",
}

_PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON under dashboards/, by file name."""
    return {
        path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))
    }


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that queries data (rows, and panels nested in collapsed rows, unpacked)."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def generated_dashboard() -> str:
    """The JSON text the dashboard generator writes, from a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, str(DASHBOARD_GENERATOR)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _differences(old: Any, new: Any, path: str) -> Iterator[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            if key not in new:
                yield f"{path}{key} only in the committed file"
            elif key not in old:
                yield f"{path}{key} only in the generated one"
            else:
                yield from _differences(old[key], new[key], f"{path}{key}.")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from _differences(a, b, f"{path}{index}.")
    elif old != new or type(old) is not type(new):
        shown = (json.dumps(value)[:80] for value in (old, new))
        yield "{}: committed {}, generated {}".format(path.rstrip("."), *shown)


def dashboard_differences(committed: dict[str, Any], generated: dict[str, Any]) -> list[str]:
    """Where two dashboards differ, panel by panel (by id, with its title), then elsewhere."""
    found = []
    old = {panel["id"]: panel for panel in committed.get("panels", [])}
    new = {panel["id"]: panel for panel in generated.get("panels", [])}
    for panel_id in sorted(old.keys() | new.keys()):
        title = (new.get(panel_id) or old[panel_id]).get("title")
        where = f"panel {panel_id} ({title!r})"
        if panel_id not in new:
            found.append(f"{where}: only in the committed file")
        elif panel_id not in old:
            found.append(f"{where}: only in the generated one")
        else:
            found += [f"{where}: {d}" for d in _differences(old[panel_id], new[panel_id], "")]
    if not found and list(old) != list(new):
        found.append(f"panel order: committed {list(old)}, generated {list(new)}")
    rest = ({k: v for k, v in d.items() if k != "panels"} for d in (committed, generated))
    found += [f"dashboard: {d}" for d in _differences(*rest, "")]
    return found


def rules() -> list[dict[str, Any]]:
    """Every rule of every group in the alert rules file."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_rules() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def recording_rules() -> dict[str, dict[str, Any]]:
    return {rule["record"]: rule for rule in rules() if "record" in rule}


def selected_families(expr: str) -> set[str]:
    """Raw families an expression selects, through the recording rules it reads."""
    recorded = recording_rules()
    names = set()
    for name in metric_names(expr):
        names |= selected_families(recorded[name]["expr"]) if name in recorded else {name}
    return names


def substitute(expr: str) -> str:
    """The expression with Grafana's template variables replaced by TEMPLATE_VALUES."""
    # Longest names first, so that a short name never replaces the prefix of a longer one.
    for name in sorted(TEMPLATE_VALUES, key=len, reverse=True):
        expr = expr.replace(name, TEMPLATE_VALUES[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords and label names excluded)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals: label values
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = re.sub(r"\boffset\s+-?\$?\w+", " ", text)  # offsets: 10m, $__rate_interval
    # Label lists of aggregations and vector matching.
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names
