"""``python -m bench.at_scale`` at 4 nodes: a smoke test of the harness, not a timed assertion.

Checks that it times every rule and dashboard query the repository ships, that the command
named every planted fault, and that the recording rules it writes back reach the alerts that
read them (the desync and hotspot alerts select the planted ranks, the others nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import need_tool

from bench.at_scale import DASHBOARDS, RULES

REPO = Path(__file__).resolve().parents[2]


def test_every_rule_and_dashboard_query_is_timed_and_every_fault_named(tmp_path: Path) -> None:
    need_tool("victoria-metrics")
    subprocess.run(
        [
            *(sys.executable, "-m", "bench.at_scale", "--nodes", "4", "--interval", "60"),
            *("--scrapes", "24", "--repeats", "1", "--out", str(tmp_path)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=600,
    )
    results = json.loads((tmp_path / "at-scale.json").read_text())
    assert results["ranks"] == 32
    assert results["status"]["named"] == {
        "hotspot": True,
        "desync": True,
        "lost": True,
        "missing": True,
        "loss spike": True,
        "origin outlier": True,
    }
    assert results["status"]["json"]["exit"] == 2
    assert results["size"]["series"] > 34 * 31

    shipped = RULES.read_text()
    timed = {rule["name"]: rule for rule in results["rules"]}
    assert all(f"record: {name}" in shipped or f"alert: {name}" in shipped for name in timed)
    assert shipped.count("- record:") + shipped.count("- alert:") == len(timed)
    firing = {name for name, rule in timed.items() if rule["kind"] == "alert" and rule["series"]}
    assert firing == {
        "AmpscopeScaleDesync",
        "AmpscopeRankLost",
        "AmpscopeInfHotspot",
        "AmpscopeLossSpike",
        "AmpscopeOriginOutlier",
    }

    targets = sum(
        len(panel.get("targets", []))
        for path in DASHBOARDS.glob("*.json")
        for top in json.loads(path.read_text())["panels"]
        for panel in (top.get("panels", []) if top["type"] == "row" else [top])
    )
    queries = [row for row in results["dashboards"] if row["range"] is not None]
    assert len(queries) == targets
    assert all(row["range"]["median_ms"] is not None for row in queries)
    assert (tmp_path / "at-scale.md").read_text().startswith("# ampscope at scale: 4 nodes")
