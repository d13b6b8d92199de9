"""``ampscope status --prometheus`` over a many-node job held by VictoriaMetrics: every
planted fault (the bad batch's loss spike and origin outlier too) is named, and the missing
rank listed.

The job is ``bench.simulated_job``'s: each node a real exporter core (store, collector,
exposition) fed schema-validated records, its scrapes imported with timestamps through
VictoriaMetrics' Prometheus import endpoint. The suite runs it at 64 nodes x 8 ranks (512) on a
2-core CI runner; ``python -m bench.at_scale`` loads the same job at 1,024 nodes x 8 ranks
and times the command (bench/README.md, "Whole job at scale").
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from status_cli import run_status
from support import need_tool

from bench.servers import victoria_metrics
from bench.simulated_job import SimulatedJob
from bench.victoria import VictoriaClient, load_job

RUN = "pretrain-7b"
NODES = 64


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SimulatedJob]]:
    """(VictoriaMetrics URL, the job it holds)."""
    path = need_tool("victoria-metrics")
    job = SimulatedJob(run=RUN, nodes=NODES)
    data = tmp_path_factory.mktemp("victoria")
    with victoria_metrics(path, data) as server:
        client = VictoriaClient(server.host, server.port)
        try:
            load_job(job, client)
            yield client.url, job
        finally:
            client.close()


def _verdicts(health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {verdict["rule"]: verdict for verdict in health["verdicts"]}


def test_json_names_every_planted_fault_and_the_missing_rank(
    loaded: tuple[str, SimulatedJob],
) -> None:
    url, job = loaded
    faults = job.faults
    result = run_status("--prometheus", url, RUN, "--json")
    assert result.returncode == 2, result.stderr  # critical: the desync
    answer = json.loads(result.stdout)
    assert answer["missing_ranks"] == [faults.missing]
    ranks = answer["ranks"]
    assert len(ranks) == job.world_size - 1
    assert all(view["node"] == job.node_of(view["rank"]) for view in ranks)
    assert {view["job_id"] for view in ranks} == {job.job_id}
    verdicts = _verdicts(answer["health"])
    assert {rule: v["status"] for rule, v in verdicts.items() if v["status"] != "ok"} == {
        "scale_desync": "critical",
        "lost_rank": "warning",
        "missing_rank": "warning",
        "inf_hotspot": "warning",
        "loss_spike": "warning",
        "origin_outlier": "warning",
    }
    desync = verdicts["scale_desync"]["evidence"]
    assert [(r["rank"], r["node"]) for r in desync["ranks"]] == [
        (faults.desync, job.node_of(faults.desync))
    ]
    assert [r["rank"] for r in verdicts["lost_rank"]["evidence"]["ranks"]] == [faults.lost]
    assert verdicts["missing_rank"]["evidence"]["ranks"] == [faults.missing]
    hotspot = verdicts["inf_hotspot"]["evidence"]
    assert hotspot["source"] == "origin"
    assert (hotspot["top"][0]["rank"], hotspot["top"][0]["node"]) == (
        faults.hotspot,
        job.node_of(faults.hotspot),
    )
    assert hotspot["top"][0]["device"] == job.hotspot_device
    assert hotspot["top"][0]["share"] >= 0.8
    # The bad batch: one spike of each kind on its rank, counted from ampscope_spikes_total.
    for rule in ("loss_spike", "origin_outlier"):
        evidence = verdicts[rule]["evidence"]
        assert [(r["rank"], r["node"], r["spikes"]) for r in evidence["ranks"]] == [
            (faults.spike, job.node_of(faults.spike), 1)
        ]
    states = answer["health"]["states"]
    assert (states["running"], states["lost"]) == (job.world_size - 2, 1)


def test_the_table_names_each_fault_its_node_and_the_missing_rank(
    loaded: tuple[str, SimulatedJob],
) -> None:
    url, job = loaded
    faults = job.faults
    result = run_status("--prometheus", url, RUN)
    assert result.returncode == 2, result.stderr
    out = result.stdout
    assert f"missing ranks (1): {faults.missing}\n" in out
    assert f"of world size {job.world_size} on {NODES} node(s)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    # One line per node; the desync's node is the critical one.
    assert lines[job.node_of(faults.desync)].endswith("CRITICAL")
    assert lines[job.node_of(faults.lost)].endswith("WARNING")
    assert "1 lost" in lines[job.node_of(faults.lost)]
    # The outliers: the desynced rank and the lost one, each with its node.
    assert lines[str(faults.desync)].split()[1] == job.node_of(faults.desync)
    assert lines[str(faults.desync)].endswith("scale_desync")
    assert lines[str(faults.lost)].split()[1:3] == [job.node_of(faults.lost), "lost"]
    assert lines[str(faults.spike)].split()[1] == job.node_of(faults.spike)
    assert lines[str(faults.spike)].endswith("loss_spike,origin_outlier")
    assert f"rank {faults.spike} (node {job.node_of(faults.spike)}) had a loss spike" in out
    assert f"rank {faults.spike}'s own gradients stood out" in out
    assert f"on node(s) {job.node_of(faults.desync)}" in out
    assert f"rank {faults.hotspot} device {job.hotspot_device} holds" in out
    assert f"rank {faults.lost} last heard" in out


def test_the_first_round_answers_with_the_ranks_that_stand_out(
    loaded: tuple[str, SimulatedJob],
) -> None:
    """At the newest scrape, the windowed counts name only the ranks that counted (the bad
    batch's rank spiked; no rank reran or diverged), the state is one series a rank, the
    second round reads the other states of the one rank not running (the lost one), and none
    is needed for the separate aligned pair (every scaler exports the packed sample)."""
    from ampscope.status import prometheus
    from ampscope.status.prometheus.ranks import not_running, without_packed
    from ampscope.verdicts.thresholds import Thresholds

    url, job = loaded
    host, port = url.removeprefix("http://").split(":")
    client = VictoriaClient(host, int(port))
    try:
        newest = client.query("max(tlast_over_time(ampscope_last_step[1h]))", time.time())
        at = float(newest[1][0]["value"][1])
        asked = prometheus.queries(RUN, Thresholds())
        answers = {name: client.query(promql, at)[1] for name, promql in asked.items()}
    finally:
        client.close()
    spike = job.faults.spike
    assert {(s["metric"]["rank"], s["metric"]["kind"]) for s in answers["spikes"]} == {
        (str(spike), "loss"),
        (str(spike), "origin_outlier"),
    }
    assert answers["reruns"] == answers["replica_checks"] == []
    # One series a rank that reported (the missing one never did); the second round reads the
    # other states of the lost rank alone.
    assert len(answers["state"]) == job.world_size - 1
    assert not_running(answers["state"]) == {(RUN, job.faults.lost)}
    assert without_packed(answers["now"]) == set()
