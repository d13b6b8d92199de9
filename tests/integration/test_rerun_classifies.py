"""A rerun that classifies: four real ranks (gloo, CPU) rerun every flagged iteration.

One launch per setup (DDP, FSDP2, and DDP with a bf16 ``GradWatch`` under ``skip``) runs
the scenarios in sequence, each rank's ``ampscope.GradScaler`` or watch (origin tracking on)
reporting to a real exporter process, beside a reference model trained with torch's own
scaler (the watch's: a plain loop that skips non-finite steps) on the same data, without a
closure or a fault:

- a NaN sample planted in rank 2's data at ``BAD_STEP``: every rank reruns, rank 2's result
  is reproduced, the step is skipped: ``reproducible_fault`` names rank 2 and the step's
  ids, and ``--suspect-batches`` lists them;
- a backward hook that corrupts rank 1's own gradients once, on the first pass of
  ``FAULT_STEP``: the rerun is clean, the step goes on with its gradients:
  ``transient_fault`` names rank 1, and the weights equal the reference's.

A third run (DDP, same launch) trains a tiny model for a few hundred clean iterations and
must never call its closure, nor fire any verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, get_json, run_distributed, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "status"))
from status_cli import run_status

pytestmark = pytest.mark.distributed

RANKS = 4
STEPS = 12
BAD_RANK, BAD_STEP, BAD_SAMPLE = 2, 4, 3
FAULT_RANK, FAULT_STEP = 1, 8
CLEAN_STEPS = 300


def sample_ids(rank: int, step: int) -> list[int]:
    return [rank * 100_000 + step * 100 + i for i in range(8)]


def _data(rank: int, step: int) -> tuple[Any, Any]:
    import torch

    data = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=data)
    y = torch.randn(8, 4, generator=data)
    if rank == BAD_RANK and step == BAD_STEP:
        x[BAD_SAMPLE] = float("nan")
    return x, y


def _model(setup: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if setup in ("ddp", "ddp-watch"):
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def _faulty(rank: int, setup: str, url: str) -> dict[str, Any]:
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    run = f"rerun-{setup}"
    watch = setup == "ddp-watch"
    model, reference = _model(setup), _model(setup)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    reporter = HttpReporter(url, flush_interval=0.05)
    scaler: Any
    if watch:
        scaler = ampscope.GradWatch("skip", reporter=reporter, run_id=run)
    else:
        scaler = ampscope.GradScaler("cpu", init_scale=1024.0, reporter=reporter, run_id=run)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=not watch)
    scaler.attach(model, track_origin=True)
    corrupt = [False]

    def poison(module: Any, grad_output: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # Fires once: the first pass's gradients of this rank only.
        if not corrupt[0]:
            return None
        corrupt[0] = False
        return (grad_output[0] * float("inf"),)

    inner = model.module if setup != "fsdp2" else model
    inner[2].register_full_backward_pre_hook(poison)
    calls = 0
    for step in range(1, STEPS + 1):
        x, y = _data(rank, step)
        scaler.note_batch(sample_ids(rank, step))
        corrupt[0] = rank == FAULT_RANK and step == FAULT_STEP
        calls += _step_with_rerun(model, opt, scaler, x, y, watch)

        ref_opt.zero_grad()
        ref_scaler.scale(_loss(reference, x, y, watch)).backward()
        if watch:  # the watch's skip, by hand: DDP spread the NaN to every rank
            if all(bool(p.grad.isfinite().all()) for p in reference.parameters()):
                ref_opt.step()
        else:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
    records = scaler.telemetry.history()
    scaler.close()
    params = [_local(p) for p in model.parameters()]
    return {
        "calls": calls,
        "reruns": {r.step: r.rerun.model_dump() for r in records if r.rerun is not None},
        "skipped": [r.step for r in records if r.skipped],
        "finite": all(bool(p.isfinite().all()) for p in params),
        "equal": all(
            bool((a == _local(b)).all())
            for a, b in zip(params, reference.parameters(), strict=True)
        ),
        "scales": (scaler.get_scale(), ref_scaler.get_scale()),
    }


def _loss(model: Any, x: Any, y: Any, bf16: bool = False) -> Any:
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def _step_with_rerun(model: Any, opt: Any, scaler: Any, x: Any, y: Any, bf16: bool = False) -> int:
    """One step that hands the front-end a closure over the same batch, as the docs show;
    how many times the closure ran (0 on a clean iteration, 1 on a flagged one)."""
    calls = 0

    def closure() -> Any:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = _loss(model, x, y, bf16)
        scaler.scale(loss).backward()
        return loss

    opt.zero_grad()
    scaler.scale(_loss(model, x, y, bf16)).backward()
    scaler.step(opt, rerun=closure)
    scaler.update()
    return calls


def _local(param: Any) -> Any:
    from torch.distributed.tensor import DTensor

    detached = param.detach()
    return detached.to_local() if isinstance(detached, DTensor) else detached


def _clean(rank: int, url: str) -> int:
    import torch
    from torch import nn

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.manual_seed(3)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscope.GradScaler(
        "cpu", reporter=HttpReporter(url, flush_interval=0.05), run_id="rerun-clean"
    )
    scaler.attach(model, track_origin=True)
    data = torch.Generator().manual_seed(rank)
    calls = 0
    for _ in range(CLEAN_STEPS):
        x, y = torch.randn(4, 4, generator=data), torch.randn(4, 1, generator=data)
        calls += _step_with_rerun(model, opt, scaler, x, y)
    scaler.close()
    return calls


def _rank(rank: int, world_size: int, setup: str, url: str) -> dict[str, Any]:
    import torch

    del world_size
    torch.set_num_threads(1)
    out = _faulty(rank, setup, url)
    if setup == "ddp":
        out["clean_calls"] = _clean(rank, url)
    return out


def _finished(url: str, run: str, steps: int) -> bool:
    if not any(r["run"] == run for r in get_json(f"{url}/api/v1/runs")):
        return False
    ranks = get_json(f"{url}/api/v1/runs/{run}/ranks")
    return len(ranks) == RANKS and all(r["step"] == steps for r in ranks)


@pytest.mark.parametrize("setup", ["ddp", "fsdp2", "ddp-watch"])
def test_reruns_tell_bad_data_from_a_transient_fault(exporter: str, setup: str) -> None:
    results = run_distributed(
        _rank,
        RANKS,
        args=(setup, exporter),
        env={"AMPSCOPE_NODE": "node0"},
        timeout=10 * DEADLOCK_GUARD_S,
    )
    for rank, out in enumerate(results):
        assert out["calls"] == 2, rank  # every rank reran both flagged steps, once each
        assert sorted(out["reruns"]) == [BAD_STEP, FAULT_STEP]
        assert out["skipped"] == [BAD_STEP]  # the reproduced NaN is still skipped
        assert out["finite"]
        assert out["equal"], f"rank {rank}'s weights differ from the clean reference's"
        assert out["scales"][0] == out["scales"][1]
        bad, fault = out["reruns"][BAD_STEP], out["reruns"][FAULT_STEP]
        assert bad["reproduced"]
        assert bad["flagged"] is (rank == BAD_RANK)
        assert fault["flagged"] is (rank == FAULT_RANK)
        assert fault["reproduced"] is (rank != FAULT_RANK)
    run = f"rerun-{setup}"
    wait_until(lambda: _finished(exporter, run, STEPS), f"all ranks of {run} at step {STEPS}")

    verdicts = {v["rule"]: v for v in get_json(f"{exporter}/api/v1/runs/{run}/health")["verdicts"]}
    transient = verdicts["transient_fault"]
    assert transient["status"] == "critical"
    (entry,) = transient["evidence"]["ranks"]
    assert (entry["rank"], entry["node"], entry["step"]) == (FAULT_RANK, "node0", FAULT_STEP)
    assert entry["device"] == f"node0:{FAULT_RANK}"
    reproducible = verdicts["reproducible_fault"]
    assert reproducible["status"] == "warning"
    (entry,) = reproducible["evidence"]["ranks"]
    assert (entry["rank"], entry["step"]) == (BAD_RANK, BAD_STEP)
    assert entry["batch_ids"] == sample_ids(BAD_RANK, BAD_STEP)

    metrics = _metrics(exporter, run)
    assert metrics == {(str(FAULT_RANK), "transient"): 1.0, (str(BAD_RANK), "reproducible"): 1.0}

    shown = run_status(run, url=exporter)
    assert shown.returncode == 2, shown.stderr  # critical: the transient fault
    assert "transient_fault" in shown.stdout
    assert "reproducible_fault" in shown.stdout

    cli = run_status(run, "--suspect-batches", url=exporter)
    assert cli.returncode == 0, cli.stderr
    suspects = {(s["step"], s["rank"]): s for s in map(json.loads, cli.stdout.splitlines())}
    assert "reproducible_fault" in suspects[(BAD_STEP, BAD_RANK)]["reasons"]
    assert suspects[(BAD_STEP, BAD_RANK)]["batch_ids"] == sample_ids(BAD_RANK, BAD_STEP)
    assert suspects[(FAULT_STEP, FAULT_RANK)]["reasons"] == ["transient_fault"]

    if setup == "ddp":
        assert [out["clean_calls"] for out in results] == [0] * RANKS
        clean = "rerun-clean"
        wait_until(lambda: _finished(exporter, clean, CLEAN_STEPS), "the clean run's ranks")
        health = get_json(f"{exporter}/api/v1/runs/{clean}/health")
        assert health["status"] == "ok", health
        assert _metrics(exporter, clean) == {}


def _metrics(url: str, run: str) -> dict[tuple[str, str], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=DEADLOCK_GUARD_S) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ampscope_reruns_total" and sample.labels["run"] == run:
                out[(sample.labels["rank"], sample.labels["result"])] = sample.value
    return out
