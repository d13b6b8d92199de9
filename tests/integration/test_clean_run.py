"""A clean run with real training fires no spike verdict; one bad batch then does.

Four real ranks (gloo, CPU; DDP, then FSDP2) train a small MLP in bf16 autocast (AdamW, a realizable
teacher-student regression with label noise, each rank its own data shard) for 300
iterations with a noisy but stable loss, each rank's ``GradWatch`` (origin tracking on)
reporting through the real ``HttpReporter`` to a real exporter process. The exporter must find
no spike: ``loss_spike``, ``grad_norm_spike`` and ``origin_outlier`` stay ok and
``ampscope_spikes_total`` stays 0. Then rank 2 alone gets one batch with its inputs multiplied
by 30: the same exporter names it (a loss spike on rank 2, rank 2's own gradients the outlier),
so the quiet part is a judgement, not an unarmed detector.

The stats are the watches' own (``StepRecord.stats``), checked against what each rank's loop
saw: the loss it computed and ``clip_grad_norm_``'s return value.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed, wait_until

from ampscope.verdicts.rollup import from_history

pytestmark = pytest.mark.distributed

PARALLEL = ("ddp", "fsdp2")
"""How the ranks train: DistributedDataParallel, or FSDP2 (``fully_shard``). Each is a run."""
RANKS = 4
STEPS = 300
BAD_RANK = 2
BAD_FACTOR = 30.0


def _mlp() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _rank(rank: int, world_size: int, url: str, go: str, parallel: str) -> dict[str, list[float]]:
    """One DDP rank: STEPS clean iterations, then (once ``go`` exists) one more, with its
    inputs multiplied by BAD_FACTOR on BAD_RANK. Returns the loop's losses and norms."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.set_num_threads(1)
    # The target is a network of the same shape: every batch is within the model's reach.
    # (A linear target under a tanh network makes rare batches the model cannot fit, whose
    # loss jumps 5x: real spikes, which the exporter rightly names.)
    torch.manual_seed(0)
    teacher = _mlp().requires_grad_(False)
    model = DistributedDataParallel(_mlp()) if parallel == "ddp" else fully_shard(_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    watch = ampscope.GradWatch(
        "skip", reporter=HttpReporter(url, flush_interval=0.05), run_id=parallel
    )
    watch.attach(model, track_origin=True)
    data = torch.Generator().manual_seed(100 + rank)
    seen: dict[str, list[float]] = {"loss": [], "norm": []}

    def train(factor: float) -> None:
        x = torch.randn(64, 16, generator=data)
        y = teacher(x) + 0.1 * torch.randn(64, 1, generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x * factor).float(), y)
        watch.scale(loss).backward()
        watch.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        seen["loss"].append(loss.item())
        seen["norm"].append(norm.item())
        watch.step(optimizer)
        watch.update()
        optimizer.zero_grad()

    for _ in range(STEPS):
        train(1.0)
    deadline = time.monotonic() + 4 * DEADLOCK_GUARD_S
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never released the bad step ({go})")
        time.sleep(0.05)
    train(BAD_FACTOR if rank == BAD_RANK else 1.0)
    dist.barrier()
    watch.close()
    return seen


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        body = response.read()
    return body.decode() if url.endswith("/metrics") else json.loads(body)


def _has_run(url: str, run: str) -> bool:
    return any(r["run"] == run for r in _get(f"{url}/api/v1/runs"))


def _verdicts(url: str, run: str) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in _get(f"{url}/api/v1/runs/{run}/health")["verdicts"]}


def _spike_counts(url: str, run: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(_get(f"{url}/metrics")):
        for sample in family.samples:
            if sample.name == "ampscope_spikes_total" and sample.labels["run"] == run:
                counts[(sample.labels["rank"], sample.labels["kind"])] = sample.value
    return counts


def _at_step(url: str, run: str, step: int) -> bool:
    if not _has_run(url, run):
        return False
    ranks = _get(f"{url}/api/v1/runs/{run}/ranks")
    return len(ranks) == RANKS and all(r["step"] == step for r in ranks)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_clean_run_fires_no_spike_and_one_bad_batch_does(
    exporter: str, tmp_path: Path, parallel: str
) -> None:
    go = tmp_path / "go"
    results: list[Any] = []
    ranks = threading.Thread(
        target=lambda: results.extend(
            run_distributed(
                _rank,
                RANKS,
                args=(exporter, str(go), parallel),
                env={"AMPSCOPE_NODE": "node0"},
                timeout=300,
            )
        ),
        daemon=True,
    )
    ranks.start()
    try:
        wait_until(lambda: _at_step(exporter, parallel, STEPS), f"all ranks at step {STEPS}", 240)
        verdicts = _verdicts(exporter, parallel)
        for rule in ("loss_spike", "grad_norm_spike", "origin_outlier"):
            assert verdicts[rule]["status"] == "ok", verdicts[rule]
        counts = _spike_counts(exporter, parallel)
        assert len(counts) == RANKS * 3
        assert set(counts.values()) == {0.0}
    finally:
        go.touch()  # the ranks end either way
        ranks.join(300)
    assert len(results) == RANKS, "the ranks failed (run_distributed reported why)"
    losses = [r["loss"] for r in results]
    # The loss is noisy (batch to batch) but stable: no trend over the last 200 iterations.
    for rank in range(RANKS):
        tail = losses[rank][100:STEPS]
        assert statistics.pstdev(tail) / statistics.fmean(tail) > 0.1  # noisy
        assert abs(sum(tail[:100]) - sum(tail[100:])) / sum(tail) < 0.1  # stable
    wait_until(lambda: _at_step(exporter, parallel, STEPS + 1), f"all ranks at step {STEPS + 1}")
    # The exporter held every step's stats, the watches' own: the windows were fed.
    series = _get(f"{exporter}/api/v1/runs/{parallel}/series?max_steps={STEPS + 1}")
    for rank in range(RANKS):
        assert series["loss"][rank] == pytest.approx(losses[rank])
        assert series["grad_norm"][rank] == pytest.approx(results[rank]["norm"], rel=1e-5)

    # One bad batch on rank 2: its loss and its own gradients jump, the others' do not.
    step = STEPS + 1
    verdicts = _verdicts(exporter, parallel)
    # The run has finished normally by now: its spikes read as history, as judged before.
    loss = from_history(verdicts["loss_spike"])
    assert loss["status"] == "warning"
    assert [(r["rank"], r["step"]) for r in loss["evidence"]["ranks"]] == [(BAD_RANK, step)]
    outlier = from_history(verdicts["origin_outlier"])
    assert outlier["status"] == "warning"
    assert outlier["summary"].startswith(f"rank {BAD_RANK}'s own gradients were x")
    assert f"the median of the other ranks at step {step}" in outlier["summary"]
    counts = _spike_counts(exporter, parallel)
    assert counts[(str(BAD_RANK), "loss")] == 1
    assert counts[(str(BAD_RANK), "origin_outlier")] == 1
    assert sum(counts.values()) == 2 + RANKS * counts[(str(BAD_RANK), "grad_norm")]
