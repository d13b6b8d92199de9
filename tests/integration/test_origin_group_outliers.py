"""Origin norms are compared only between replicas of one data-parallel group.

Four real ranks (gloo, CPU) laid out as a pipeline stage of its own (rank 0, a DDP over a
group of one, whose parameters, and so its own gradient norm, are x20 the others' at every
step, as a pipeline's head stage is) and a stage of three data-parallel replicas (ranks 1-3,
one DDP over them). Each rank's ``GradWatch`` tracks the origin and reports to a real
exporter process. Rank 2's batch at step ``OUTLIER_STEP`` is x30 its replicas'. The exporter
must name rank 2 at that step as the one origin outlier, and never rank 0: before origin
groups, rank 0 stood out at every step and filled /suspect-batches with healthy steps.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed, wait_until

pytestmark = pytest.mark.distributed

RANKS = 4
STEPS = 30
OUTLIER_RANK, OUTLIER_STEP = 2, 21
HEAD_FACTOR = 20.0
RUN = "origin-groups"


def _rank(rank: int, world_size: int, url: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.set_num_threads(1)
    # Every rank creates every group, in the same order (torch requires it).
    groups = [dist.new_group([0]), dist.new_group([1, 2, 3])]
    torch.manual_seed(1)
    model = DistributedDataParallel(
        torch.nn.Linear(16, 1), process_group=groups[0 if rank == 0 else 1]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = ampscope.GradWatch("skip", reporter=HttpReporter(url, flush_interval=0.05), run_id=RUN)
    watch.attach(model, track_origin=True)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 16, generator=data)
        y = torch.randn(16, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 0:
            loss = loss * HEAD_FACTOR  # another stage: other parameters, other norms
        if (rank, step) == (OUTLIER_RANK, OUTLIER_STEP):
            loss = loss * 30.0
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()
        optimizer.zero_grad()
    watch.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.loads(response.read())


def _finished(url: str) -> bool:
    if not any(r["run"] == RUN for r in _get(f"{url}/api/v1/runs")):
        return False
    ranks = _get(f"{url}/api/v1/runs/{RUN}/ranks")
    return len(ranks) == RANKS and all(r["step"] == STEPS for r in ranks)


def test_a_stage_of_its_own_is_never_an_origin_outlier_a_replica_is(exporter: str) -> None:
    results: list[Any] = []
    ranks = threading.Thread(
        target=lambda: results.extend(
            run_distributed(
                _rank, RANKS, args=(exporter,), env={"AMPSCOPE_NODE": "node0"}, timeout=300
            )
        ),
        daemon=True,
    )
    ranks.start()
    ranks.join(300)
    assert len(results) == RANKS, "the ranks failed (run_distributed reported why)"
    wait_until(lambda: _finished(exporter), f"all ranks at step {STEPS}")

    # Each rank names its data-parallel group once attached with origin tracking.
    for rank, group in [(0, (0, 1)), (1, (1, 3)), (2, (1, 3)), (3, (1, 3))]:
        history = _get(f"{exporter}/api/v1/runs/{RUN}/ranks/{rank}/history?limit=1000")
        records = history["records"] if isinstance(history, dict) else history
        assert {(r["setup"]["origin_group"]["first"], r["setup"]["origin_group"]["size"])
                for r in records} == {group}  # fmt: skip
        origin = [r["stats"]["grad_norm_origin"] for r in records]
        if rank == 0:
            head = origin
        elif rank == 1:
            replica = origin
    # The head stage's own norms stand x10 or more above the others' at most steps: the
    # comparison the exporter must not make.
    assert sum(h >= 10 * r for h, r in zip(head, replica, strict=True)) > STEPS // 2

    suspects = _get(f"{exporter}/api/v1/runs/{RUN}/suspect-batches")
    outliers = [(s["step"], s["rank"]) for s in suspects if "origin_outlier" in s["reasons"]]
    assert outliers == [(OUTLIER_STEP, OUTLIER_RANK)]
    verdicts = {v["rule"]: v for v in _get(f"{exporter}/api/v1/runs/{RUN}/health")["verdicts"]}
    evidence = verdicts["origin_outlier"]["evidence"]  # history: the run finished since
    assert evidence["was"] == "warning"
    (entry,) = evidence["ranks"]
    # Compared with its two replicas only, never with the other stage.
    assert (entry["rank"], entry["step"], entry["spikes"], entry["compared"]) == (
        OUTLIER_RANK,
        OUTLIER_STEP,
        1,
        2,
    )
