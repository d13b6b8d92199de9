"""The demo's printed output, from hand-made progress reports and exporter JSON."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from ampscope.demo.report import (
    ampscope_command,
    health_lines,
    keep_serving_hint,
    missing_verdicts,
    progress_lines,
    rank_table,
    ranks_text,
    where_to_look,
)
from ampscope.demo.scenarios import SCENARIOS
from ampscope.demo.trainer import Progress
from ampscope.exporter.metrics.catalogue import BY_NAME
from ampscope.status.render import scale_text


def test_scales_print_as_powers_of_two() -> None:
    assert scale_text(65536.0) == "2^16"
    assert scale_text(0.25) == "2^-2"
    assert scale_text(3.0) == "3"
    assert scale_text(0.0) == "0"
    assert ranks_text([1024.0, 2048.0]) == "2^10 2^11"
    assert ranks_text([8.0] * 8) == "2^3 (all 8)"
    assert ranks_text([8.0] * 7 + [2.0]) == "2^1..2^3"


def test_progress_lines_flag_disagreeing_ranks() -> None:
    scenarios = (SCENARIOS["overflow"], SCENARIOS["desync"])
    reports = [
        Progress(rank=1, step=20, scales=(65536.0, 4096.0), skipped=(4, 0)),
        Progress(rank=0, step=20, scales=(65536.0, 32768.0), skipped=(4, 0)),
    ]
    lines = progress_lines(20, 60, scenarios, reports)
    assert lines[0].startswith("step   20/60  overflow  scale 2^16 2^16")
    assert lines[0].endswith("skipped   4")
    assert "ranks disagree" not in lines[0]
    # Rank order, not arrival order.
    assert "scale 2^15 2^12" in lines[1]
    assert lines[1].endswith("<- ranks disagree")


def _rank(rank: int, scale: float, origin: int, params: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rank": rank,
        "state": "finished",
        "step": 30,
        "scale": scale,
        "totals": {
            "steps": 30,
            "skipped_steps": 6,
            "backoffs": 6,
            "growths": 5,
            "found_inf_local": {"cpu": 6},
            "found_inf_origin": {"cpu": origin},
            "nonfinite_params": params,
        },
    }


def test_rank_table_shows_totals_and_top_parameter() -> None:
    rows = rank_table(
        [
            _rank(1, 32768.0, 6, [{"name": "a", "count": 3}, {"name": "head.weight", "count": 9}]),
            _rank(0, 32768.0, 0, []),
        ]
    )
    assert rows[0].split()[:4] == ["rank", "state", "step", "scale"]
    assert rows[1].split() == ["0", "finished", "30", "2^15", "6/30", "6", "5", "6", "0", "-"]
    assert rows[2].split()[:4] == ["1", "finished", "30", "2^15"]
    assert rows[2].split()[-2:] == ["head.weight", "(9)"]


HEALTH = {
    "status": "critical",
    "state": "finished",
    "states": {"running": 0, "stalled": 0, "lost": 0, "finished": 2},
    "verdicts": [
        {"rule": "scale_collapse", "status": "critical", "summary": "collapsed on 2 rank(s)"},
        {"rule": "skip_storm", "status": "ok", "summary": ""},
        {"rule": "scale_desync", "status": "ok", "summary": ""},
        {"rule": "inf_hotspot", "status": "warning", "summary": "rank 1 holds 100%"},
        # The finished run's spike: history (rollup.as_history), ok.
        {
            "rule": "loss_spike",
            "status": "ok",
            "summary": "history, the run finished normally since: loss spiked",
            "evidence": {"history": True},
        },
        {"rule": "grad_norm_spike", "status": "ok", "summary": "", "evidence": {}},
    ],
}


def test_health_lines_and_missing_verdicts() -> None:
    lines = health_lines(HEALTH, expected=("scale_collapse", "skip_storm"))
    assert lines[0] == "  health: CRITICAL   ranks: 2 finished"
    assert "no alert fires for it" in lines.pop(1)
    assert lines[1].split() == [
        "CRIT",
        "scale_collapse",
        "collapsed",
        "on",
        "2",
        "rank(s)",
        "(expected)",
    ]
    assert lines[2].split() == ["WARN", "inf_hotspot", "rank", "1", "holds", "100%"]
    assert lines[3].split()[:3] == ["hist", "loss_spike", "history,"]
    assert lines[4].split() == ["ok", "skip_storm,", "scale_desync,", "grad_norm_spike"]
    assert missing_verdicts(HEALTH, ("scale_collapse", "skip_storm")) == ["skip_storm"]
    assert missing_verdicts(HEALTH, ("inf_hotspot", "loss_spike")) == []
    assert missing_verdicts(HEALTH, ("grad_norm_spike",)) == ["grad_norm_spike"]


def test_the_promql_to_try_names_catalogued_metrics_only() -> None:
    lines = where_to_look("http://127.0.0.1:9478", ["d-overflow", "d-spike"], None)
    promql = "\n".join(lines[next(i for i, line in enumerate(lines) if "PromQL" in line) + 1 :])
    # Recording rules (ampscope_run:loss_scale:...) come from the rules file, not the catalogue.
    names = set(re.findall(r"\bampscope_\w+\b(?!:)", promql))
    assert {"ampscope_loss_scale", "ampscope_spikes_total"} <= names
    assert names <= set(BY_NAME), names - set(BY_NAME)


def test_printed_commands_run_as_printed(monkeypatch: Any, tmp_path: Path) -> None:
    """``ampscope`` where the name on PATH is this installation's, else the venv's script by
    its path (a venv that is not activated), else this interpreter with ``-m``."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text("")
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert ampscope_command() == f"{python} -m ampscope.cli"  # no script beside it
    script = bin_dir / "ampscope"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert ampscope_command() == str(script)  # not on PATH: the full path
    monkeypatch.setenv("PATH", str(bin_dir))
    assert ampscope_command() == "ampscope"  # activated
    other = tmp_path / "other"
    other.mkdir()
    (other / "ampscope").write_text("#!/bin/sh\n")
    (other / "ampscope").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}:{bin_dir}")
    assert ampscope_command() == str(script)  # another installation's comes first


def test_a_stopped_exporter_gets_no_links_but_the_way_to_keep_it() -> None:
    lines = keep_serving_hint("/opt/venv/bin/ampscope", ["--scenario", "spike", "--steps", "40"])
    assert lines[-1] == "  /opt/venv/bin/ampscope demo --scenario spike --steps 40 --keep-serving"
    assert not [line for line in lines if "http://" in line]
    lines = where_to_look("http://127.0.0.1:9478", ["d-rerun"], None, "d-rerun", "/v/ampscope")
    assert "  terminal      /v/ampscope status --url http://127.0.0.1:9478 d-rerun" in lines
