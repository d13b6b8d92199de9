"""``ampscope status`` shows the spike verdicts, for one exporter and merged over two: two
live exporter processes stand in for two nodes of four ranks, fed records whose stats hold a
loss spike on rank 0, a gradient-norm spike on every rank and an origin outlier on rank 3."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator

import pytest
from exporter.factory import body, record, stats
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess

RUN = "spiky"
NODES = {"n0": (0, 1), "n1": (2, 3)}
LOSS_SPIKE = (0, 45)
"""(rank, step) of the loss spike."""
NORM_SPIKE = 50
OUTLIER = (3, 40)
"""(rank, step) whose own gradients are x25 the other ranks'."""


def _records(node: str, rank: int) -> list:
    rng = random.Random(rank)
    out = []
    for step in range(1, 61):
        loss = 50.0 if (rank, step) == LOSS_SPIKE else rng.gauss(2.0, 0.05)
        norm = 40.0 if step == NORM_SPIKE else rng.gauss(1.0, 0.03)
        origin = rng.gauss(1.0, 0.03)
        if step == OUTLIER[1]:
            origin = 25.0 if rank == OUTLIER[0] else 1.0
        out.append(
            record(
                step,
                rank=rank,
                node=node,
                world_size=4,
                local_world_size=2,
                run=RUN,
                stats=stats(loss, norm, origin),
            )
        )
    return out


@pytest.fixture(scope="module")
def exporters() -> Iterator[dict[str, str]]:
    processes = {node: ExporterProcess(free_port()) for node in NODES}
    try:
        for node, process in processes.items():
            process.start()
            for rank in NODES[node]:
                request = urllib.request.Request(
                    process.url + "/api/v1/ingest",
                    data=body(*_records(node, rank)),
                    headers={"Content-Type": "application/json"},
                    method="POST",
                )
                with urllib.request.urlopen(request, timeout=DEADLOCK_GUARD_S) as response:
                    assert response.status == 200
        yield {node: process.url for node, process in processes.items()}
    finally:
        for process in processes.values():
            process.stop()


def _verdicts(result) -> dict:  # type: ignore[no-untyped-def]
    return {v["rule"]: v for v in json.loads(result.stdout)["health"]["verdicts"]}


def test_one_exporter_names_the_loss_spike_and_the_step_of_the_norm_spike(
    exporters: dict[str, str],
) -> None:
    result = run_status(RUN, url=exporters["n0"])
    assert result.returncode == 1, result.stderr  # warnings
    lines = result.stdout.splitlines()
    (loss,) = [line for line in lines if "loss_spike" in line and "WARN" in line]
    assert "loss spiked on rank 0 (node n0) at step 45: 50 against a baseline mean 2" in loss
    (norm,) = [line for line in lines if "grad_norm_spike" in line and "WARN" in line]
    assert "gradient norm spiked at step 50: 40 against" in norm
    assert "seen by 2 rank(s)" in norm
    # This node's ranks are both ordinary: no outlier among them.
    verdicts = _verdicts(run_status(RUN, "--json", url=exporters["n0"]))
    assert verdicts["origin_outlier"]["status"] == "ok"
    assert verdicts["loss_spike"]["evidence"]["ranks"][0]["step"] == 45


def test_merged_status_names_the_outlier_of_the_other_node(exporters: dict[str, str]) -> None:
    urls = [arg for url in exporters.values() for arg in ("--url", url)]
    result = run_status(RUN, *urls)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    (outlier,) = [line for line in lines if "origin_outlier" in line and "WARN" in line]
    assert "rank 3's own gradients were x25" in outlier
    assert "the median of the other ranks at step 40" in outlier
    # The outlier ranks' table names each rank by the rules that flag it.
    (row,) = [line for line in lines if line.split()[:2] == ["3", "n1"]]
    assert "origin_outlier" in row
    verdicts = _verdicts(run_status(RUN, "--json", *urls))
    assert verdicts["origin_outlier"]["evidence"]["exporters"][0]["url"] == exporters["n1"]
    # Every exporter saw the same grad-norm spike: one verdict naming the step.
    norm = verdicts["grad_norm_spike"]
    assert norm["evidence"]["steps"][0]["step"] == NORM_SPIKE
    assert len(norm["evidence"]["exporters"]) == 2
    assert [r["rank"] for r in verdicts["loss_spike"]["evidence"]["ranks"]] == [0]
