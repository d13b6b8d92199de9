"""The quick benchmark end to end: a smoke test of the harness, not a timed assertion.

Runs ``python -m bench --mode quick`` exactly as a user would (real ``ampscope serve``,
real Pushgateway, two spawned gloo ranks) and checks that every figure it publishes is
present, finite and positive, and that the reporters' records all reached the exporter.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import need_tool

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed, pytest.mark.prometheus]


def _numbers(node: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(node, bool):
        return []
    if isinstance(node, int | float):
        return [(path, float(node))]
    if isinstance(node, dict):
        return [n for k, v in node.items() for n in _numbers(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [n for i, v in enumerate(node) for n in _numbers(v, f"{path}[{i}]")]
    return []


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _check_summary(summary: dict[str, Any]) -> None:
    assert summary["n"] > 0
    assert 0 < summary["p25"] <= summary["median"] <= summary["p75"]
    assert summary["ci_low"] <= summary["median"] <= summary["ci_high"]


def _check_ratio(ratio: dict[str, Any]) -> None:
    assert _positive(ratio["median"])
    assert ratio["ci_low"] <= ratio["median"] <= ratio["ci_high"]
    assert ratio["groups"] >= 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    need_tool("prometheus-pushgateway")
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--mode", "quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "quick.json").read_text()), (out / "quick.md").read_text()


def test_every_number_is_finite(results: tuple[dict[str, Any], str]) -> None:
    data, _ = results
    numbers = _numbers(data)
    assert len(numbers) > 100
    assert [p for p, v in numbers if not math.isfinite(v)] == []


def test_machine_and_run_description(results: tuple[dict[str, Any], str]) -> None:
    data, markdown = results
    machine = data["machine"]
    assert data["mode"] == "quick"
    assert data["command"].startswith("python -m bench --mode quick")
    assert machine["cpu_cores"] >= 1
    assert machine["memory_bytes"] > 0
    for key in ("cpu_model", "os", "python", "torch", "ampscope", "date"):
        assert machine[key], key
    assert len(machine["git_commit"]) == 40
    assert machine["pushgateway"].startswith("pushgateway")
    assert data["gpu"]["status"].startswith("not run")
    assert _positive(data["duration_s"])
    assert "## Scaler overhead (cpu, 1 intra-op thread per process)" in markdown
    assert "## Exporter vs Pushgateway" in markdown


def test_scaler_section(results: tuple[dict[str, Any], str]) -> None:
    scaler = results[0]["scaler"]
    single = scaler["single_process"]
    for name in ("stock", "ampscope_no_reporter", "ampscope_stats_off", "ampscope"):
        _check_summary(single["samples"][name])
    for name in ("ampscope_no_reporter", "ampscope_stats_off", "ampscope"):
        _check_ratio(single["ratio"][name])
    _check_ratio(single["stats_vs_off"])
    dist = scaler["distributed"]
    assert (dist["world_size"], dist["backend"]) == (2, "gloo")
    for name in ("stock", "ampscope", "ampscope_origin"):
        _check_summary(dist["samples"][name])
    for name in ("ampscope", "ampscope_origin"):
        _check_ratio(dist["ratio"][name])
    _check_ratio(dist["origin_vs_ampscope"])
    micro = scaler["update_cost"]
    assert set(micro["step_update_us"]) == {
        "stock",
        "ampscope_no_reporter",
        "ampscope_stats_off",
        "ampscope_reporter",
    }
    assert all(_positive(v) for v in micro["step_update_us"].values())
    assert set(micro["step_update_cpu_us"]) == set(micro["step_update_us"])
    assert all(_positive(v) for v in micro["step_update_cpu_us"].values())
    assert _positive(micro["telemetry_thread_cpu_us_per_record"])
    assert _positive(micro["telemetry_thread_cpu_us_per_record_stats_off"])
    assert (
        set(micro["stats_extra_us"])
        == set(micro["stats_extra_cpu_us"])
        == {
            "median",
            "p25",
            "p75",
        }
    )
    assert _positive(micro["reporter_thread_cpu_us_per_record"])
    overflow = scaler["overflow"]
    assert all(_positive(v) for v in overflow["step_update_ms"].values())
    # Every timed (and warm-up) iteration really overflowed, for every contender.
    backoffs = overflow["backoffs"]
    assert len(set(backoffs.values())) == 1
    assert backoffs["stock"] > overflow["iterations_per_contender"]
    watch = scaler["watch"]
    for model in ("tiny", "mlp"):
        cost = watch[model]
        watches = {"watch_observe", "watch_skip", "watch_observe_stats_off"}
        assert set(cost["step_us"]) == {"plain", *watches}
        assert all(_positive(v) for v in cost["step_us"].values())
        assert set(cost["extra_cpu_us"]) == watches
        assert set(cost["stats_extra_us"]) == {"median", "p25", "p75"}
        # Every timed and warm-up iteration of each watch made its record.
        made = cost["iterations_per_contender"] + cost["warmup_iterations"]
        assert set(cost["records"].values()) == {made}
    # The reporters were on and lost nothing.
    assert scaler["exporter_records_expected"] > 0
    assert scaler["exporter_records_received"] == scaler["exporter_records_expected"]


def test_exporter_section(results: tuple[dict[str, Any], str]) -> None:
    exporter = results[0]["exporter"]
    config = results[0]["config"]["exporter"]
    for server in ("ampscope", "pushgateway"):
        data = exporter[server]
        assert set(data["ingest"]) == {"8", "64"}
        for phase in data["ingest"].values():
            assert phase["requests"] > 0
            assert _positive(phase["records_per_second"])
            assert 0 < phase["latency_ms"]["p50"] <= phase["latency_ms"]["p99"]
        scrape = data["scrape"]
        # At least every device- and param-labelled series of every rank is exposed.
        series = 64 * (2 * config["devices"] + config["top_k"])
        assert scrape["samples"] >= series, server
        assert scrape["size_bytes"] > 0
        assert 0 < scrape["latency_ms"]["p50"] <= scrape["latency_ms"]["p99"]
        # The scrape's samples were counted in the decompressed body (load.scrape).
        assert 0 < data["scrape_gzip"]["size_bytes"] < scrape["size_bytes"] / 4, server
        assert data["scrape_gzip"]["latency_ms"]["p50"] > 0
        after_change = data["scrape_after_change"]["latency_ms"]
        assert 0 < after_change["p50"] <= after_change["p99"]
        checkpoints = data["memory"]["checkpoints"]
        assert [c["records"] for c in checkpoints] == sorted(c["records"] for c in checkpoints)
        assert checkpoints[-1]["records"] >= config["rss_checkpoints"][-1]
        assert all(c["rss_bytes"] > 2**20 for c in checkpoints)
    ratio = exporter["ratio"]
    assert all(_positive(v) for _, v in _numbers(ratio))
    memory = exporter["ampscope"]["memory"]
    # Quick mode sends fewer records per rank than the history holds: all are held.
    assert memory["held_records"] == memory["checkpoints"][-1]["records"]
    assert _positive(memory["rss_per_held_record_bytes"])
