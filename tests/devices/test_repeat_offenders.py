"""Repeat offenders end to end, with real parts: a real exporter, a real Prometheus scraping
it every second with the shipped rules, and four short runs of 2 gloo ranks reporting
through the default reporter.

In runs dev-a, dev-b and dev-c, local rank 1 on node n1 is the origin of a non-finite
gradient; in run dev-d, local rank 0 on node n2 is, once. Without a GPU each device is named
``<node>:<local_rank>``: ``ampscope devices`` must name n1:1 first with 3 runs and exit 1,
list n2:0 with 1 run unflagged, and the alert must fire for n1:1 only. The rules are loaded
as shipped except that ``for:`` becomes 1 s; the promtool tests check the real durations.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import (
    DEADLOCK_GUARD_S,
    free_port,
    need_tool,
    run_distributed,
    start_prometheus,
    stop_process,
)

from ampscope.demo.exporter import ExporterProcess
from ampscope.rank.telemetry.identity import sanitize_label

pytestmark = [pytest.mark.prometheus, pytest.mark.distributed]

RULES_FILE = Path(__file__).parents[2] / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
RUNS = {"dev-a": ("n1", 1), "dev-b": ("n1", 1), "dev-c": ("n1", 1), "dev-d": ("n2", 0)}
"""Run -> (node of both its ranks, the local rank whose gradients turn non-finite)."""
STEPS = 6
POISON_STEP = 3


def _train(rank: int, world_size: int, culprit: int) -> dict[str, Any]:
    """One rank: a DDP model under an ampscope scaler with origin tracking; the culprit's
    input holds an inf at POISON_STEP. Both ranks see the same data otherwise, so no rank's
    own gradient norm stands out."""
    import torch

    import ampscope

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10)  # reports to AMPSCOPE_URL
    scaler.attach(model, track_origin=True)
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    for step in range(1, STEPS + 1):
        batch = data.clone()
        if step == POISON_STEP and rank == culprit:
            batch[0, 0] = float("inf")
        scaler.scale(model(batch).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    first = scaler.telemetry.history()[0]
    found = dict(scaler.telemetry.snapshot().found_inf_origin)
    scaler.close()
    return {"origin": found, "device": first.device.device if first.device else None}


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def _until(prometheus: str, promql: str, expected: Any, key: Any) -> None:
    """Wait until ``key(samples of promql)`` equals ``expected``."""
    deadline = time.monotonic() + DEADLOCK_GUARD_S * 2
    while (got := key(_query(prometheus, promql))) != expected:
        assert time.monotonic() < deadline, (promql, got)
        time.sleep(0.2)


def _devices(prometheus: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "devices", "--prometheus", prometheus, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """(Prometheus URL, run -> its ranks' results) once every run finished and was scraped."""
    need_tool("prometheus")
    workdir = tmp_path_factory.mktemp("devices")
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
    exporter = ExporterProcess(free_port())
    prometheus = None
    try:
        exporter.start()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yml")],
            "scrape_configs": [
                {
                    "job_name": "ampscope",
                    "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}],
                }
            ],
        }
        prometheus, prometheus_url = start_prometheus(config, workdir)
        results = {}
        for run, (node, culprit) in RUNS.items():
            env = {"AMPSCOPE_URL": exporter.url, "AMPSCOPE_RUN_ID": run, "AMPSCOPE_NODE": node}
            results[run] = run_distributed(_train, 2, (culprit,), env=env)
        # Prometheus scraped every run's offences.
        _until(
            prometheus_url,
            "ampscope_device_offences_total",
            {("dev-a", "n1:1", "1"), ("dev-b", "n1:1", "1"), ("dev-c", "n1:1", "1"),
             ("dev-d", "n2:0", "1")},
            lambda samples: {
                (s["metric"]["run"], s["metric"]["device"], s["value"][1]) for s in samples
            },
        )  # fmt: skip
        yield prometheus_url, results
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        exporter.stop()


def test_each_rank_named_its_device_and_only_the_culprit_offended(
    fleet: tuple[str, dict[str, Any]],
) -> None:
    prometheus, results = fleet
    for run, (node, culprit) in RUNS.items():
        assert [r["device"] for r in results[run]] == [f"{node}:0", f"{node}:1"], run
        assert [r["origin"] for r in results[run]] == [
            {"cpu": int(rank == culprit)} for rank in (0, 1)
        ], run
    info = _query(prometheus, 'ampscope_rank_info{run="dev-d"}')
    # Without a GPU, no PCI address: an empty label, which Prometheus does not store.
    assert sorted((s["metric"]["device"], "pci_bus_id" in s["metric"]) for s in info) == [
        ("n2:0", False),
        ("n2:1", False),
    ]
    hostname = sanitize_label(socket.gethostname())
    assert {s["metric"]["hostname"] for s in info} == {hostname}


def test_ampscope_devices_names_the_repeat_offender_first(
    fleet: tuple[str, dict[str, Any]],
) -> None:
    prometheus, _ = fleet
    done = _devices(prometheus, "--since", "1h", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    listed = json.loads(done.stdout)
    assert [(d["device"], d["node"], d["runs"], d["flagged"]) for d in listed] == [
        ("n1:1", "n1", 3, True),
        ("n2:0", "n2", 1, False),
    ]
    assert [d["offences"] for d in listed] == [
        {"nonfinite_origin": 3, "transient_fault": 0, "replica_divergence": 0},
        {"nonfinite_origin": 1, "transient_fault": 0, "replica_divergence": 0},
    ]
    assert listed[0]["run_ids"] == ["dev-a", "dev-b", "dev-c"]
    assert [d["last_run"] for d in listed] == ["dev-c", "dev-d"]
    assert all(d["last_offence_time"] is not None for d in listed)
    assert all(d["dcgm"] == {} for d in listed)  # no GPU, no DCGM series
    # The text table: the same order, the offender marked, the threshold settable.
    table = _devices(prometheus, "--since", "1h")
    assert table.returncode == 1
    rows = [line.split() for line in table.stdout.splitlines()]
    listed_rows = [row for row in rows if "n1:1" in row or "n2:0" in row]
    assert [row[:4] for row in listed_rows] == [["!", "n1:1", "n1", "3"], ["n2:0", "n2", "1", "1"]]
    assert _devices(prometheus, "--since", "1h", "--min-runs", "4").returncode == 0


def test_the_alert_fires_for_the_repeat_offender_only(fleet: tuple[str, dict[str, Any]]) -> None:
    prometheus, _ = fleet
    _until(
        prometheus,
        'ALERTS{alertname="AmpscopeRepeatOffenderDevice", alertstate="firing"}',
        {("n1:1", None)},
        lambda samples: {(s["metric"]["device"], s["metric"].get("node")) for s in samples},
    )
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=DEADLOCK_GUARD_S) as r:
        alerts = json.load(r)["data"]["alerts"]
    (alert,) = [a for a in alerts if a["labels"]["alertname"] == "AmpscopeRepeatOffenderDevice"]
    assert alert["annotations"]["summary"] == "Device n1:1 offended in 3 runs"
    assert "Ranks on device n1:1 (node n1) were" in alert["annotations"]["description"]
    assert "in 3 runs within 30 days: dev-a, dev-b, dev-c." in alert["annotations"]["description"]
    recorded = _query(prometheus, "ampscope_device:offending_runs:count_30d")
    assert sorted((s["metric"]["device"], s["value"][1]) for s in recorded) == [
        ("n1:1", "3"),
        ("n2:0", "1"),
    ]
