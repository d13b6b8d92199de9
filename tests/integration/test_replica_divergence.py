"""Replicas that stop agreeing: four real ranks (gloo, CPU) corrupt one bit and are named.

One launch runs the scenarios in sequence, each its own run reporting to a real exporter
process, each rank checking its replicas every ``EVERY`` iterations:

- ``ddp-watch``: DDP with a ``GradWatch``; after the optimizer step of ``FLIP_STEP``, rank
  2 flips the lowest mantissa bit of one element of ``2.weight`` (finite, tiny):
  ``replica_divergence`` names rank 2, the parameter and the first check after the flip,
  and the device offence is rank 2's device's alone;
- ``ddp-scaler``: the same under the fp16 ``GradScaler`` (a high initial scale backs off
  first), rank 3 flipping;
- ``ddp-adam``: one element of rank 1's ``exp_avg`` (Adam's optimizer state) is corrupted;
  the weights the next step produces differ and the check names rank 1;
- ``hsdp``: FSDP2 over a 2 x 2 (replicate x shard) mesh; rank 3 flips a bit of its shard:
  its replica group is ranks 1 and 3, two replicas without a majority: both named, no
  device blamed; ranks 0 and 2 keep agreeing;
- ``fsdp1-hybrid``: FSDP1 ``HYBRID_SHARD`` over the same mesh with a
  ``ShardedGradScaler``; rank 2 flips a bit of its FlatParameter shard: its inter-node
  group, ranks 0 and 2, names ``0.weight`` (the original parameter inside the shard);
- ``clean``: ``CLEAN_STEPS`` iterations with dropout and fp16 backoffs, checked every
  iteration: never a divergence, the run stays ok.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, get_json, run_distributed, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "status"))
from status_cli import run_status

pytestmark = pytest.mark.distributed

RANKS = 4
EVERY = 4
STEPS = 14
FLIP_STEP = 6
"""The flip follows this step's optimizer step: the check of step 8 is the first to see it."""
FIRST_SEEN = 8
CLEAN_STEPS = 300
FLIPS = {"ddp-watch": (2, "2.weight"), "ddp-scaler": (3, "0.bias"), "ddp-adam": (1, "0.weight")}
HSDP_FLIP = (3, "0.weight")
FSDP1_FLIP = (2, "0.weight")


def _model(scenario: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))
    if scenario not in ("hsdp", "fsdp1-hybrid"):
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if scenario == "fsdp1-hybrid":
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
            device_id=torch.device("cpu"),
        )
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _flip_low_bit(tensor: Any) -> None:
    """Flip the lowest mantissa bit of element 1 of ``tensor``, in place (float32)."""
    import torch

    bits = tensor.detach().reshape(-1).view(torch.int32)
    bits[1] ^= 1


def _named(model: Any, name: str) -> Any:
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "module", model)
    param = dict(inner.named_parameters())[name]
    return param.to_local() if isinstance(param, DTensor) else param


def _run(rank: int, scenario: str, url: str) -> dict[str, Any]:
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    clean = scenario == "clean"
    model = _model(scenario)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    reporter = HttpReporter(url, flush_interval=0.05)
    run = f"replicas-{scenario}"
    scaler: Any
    if scenario == "fsdp1-hybrid":
        scaler = ampscope.ShardedGradScaler("cpu", reporter=None)
    elif scenario in ("ddp-watch", "ddp-adam", "hsdp"):
        scaler = ampscope.GradWatch(reporter=reporter, run_id=run)
    else:  # the highest initial scale: fp16 backoffs (skipped steps) while the checks run
        scaler = ampscope.GradScaler("cpu", init_scale=2.0**127, reporter=reporter, run_id=run)
    scaler.attach(model, replica_check_every=1 if clean else EVERY)
    flip = {"hsdp": HSDP_FLIP, "fsdp1-hybrid": FSDP1_FLIP}.get(scenario) or FLIPS.get(scenario)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(1, (CLEAN_STEPS if clean else STEPS) + 1):
        opt.zero_grad()
        x, y = torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y) * 100.0
        scaler.scale(loss).backward()
        scaler.step(opt)
        if flip is not None and rank == flip[0] and step == FLIP_STEP:
            if scenario == "ddp-adam":  # the optimizer's state, not the weight
                state = opt.state[dict(model.module.named_parameters())[flip[1]]]
                state["exp_avg"].view(-1)[1] *= 3.0  # finite; the next step's update moves
            elif scenario == "fsdp1-hybrid":  # the rank's FlatParameter shard
                _flip_low_bit(next(model.parameters()))
            else:
                _flip_low_bit(_named(model, flip[1]))
        scaler.update()
    records = scaler.telemetry.history(CLEAN_STEPS)
    scaler.close()
    out = [(r.step, r.replicas.model_dump()) for r in records if r.replicas is not None]
    return {"checks": out, "skipped": sum(r.skipped for r in records)}


def _rank(rank: int, world_size: int, url: str) -> dict[str, Any]:
    import torch

    del world_size
    torch.set_num_threads(1)
    scenarios = ("ddp-watch", "ddp-scaler", "ddp-adam", "hsdp", "fsdp1-hybrid", "clean")
    return {s: _run(rank, s, url) for s in scenarios}


def _finished(url: str, run: str, steps: int) -> bool:
    if not any(r["run"] == run for r in get_json(f"{url}/api/v1/runs")):
        return False
    ranks = get_json(f"{url}/api/v1/runs/{run}/ranks")
    return len(ranks) == RANKS and all(r["step"] == steps for r in ranks)


def _samples(url: str, name: str, run: str, *keys: str) -> dict[tuple[str, ...], float]:
    """``name``'s samples of ``run`` on the exporter's /metrics: the ``keys`` labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=DEADLOCK_GUARD_S) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels["run"] == run:
                out[tuple(sample.labels[k] for k in keys)] = sample.value
    return out


def _verdict(url: str, run: str) -> dict[str, Any]:
    report = get_json(f"{url}/api/v1/runs/{run}/health")
    (verdict,) = [v for v in report["verdicts"] if v["rule"] == "replica_divergence"]
    return verdict


def test_a_flipped_bit_is_named_by_rank_parameter_and_step(exporter: str) -> None:
    results = run_distributed(
        _rank,
        RANKS,
        args=(exporter,),
        env={"AMPSCOPE_NODE": "node0"},
        timeout=10 * DEADLOCK_GUARD_S,
    )
    checks = [s for s in range(1, STEPS + 1) if s % EVERY == 0]
    for scenario, (bad, param) in FLIPS.items():
        for rank, out in enumerate(results):
            seen = dict(out[scenario]["checks"])
            assert sorted(seen) == checks, (scenario, rank)
            for step, check in seen.items():
                if step < FIRST_SEEN:
                    assert check["agree"], (scenario, rank, step)
                else:  # every rank of the group sees the same, and it stays
                    assert not check["agree"], (scenario, rank, step)
                    assert check["ranks"] == [bad]
                    assert check["majority"]
                    assert check["parameters"] == [param], (scenario, check)
                    assert check["replicas"] == RANKS
        run = f"replicas-{scenario}"
        wait_until(lambda run=run: _finished(exporter, run, STEPS), f"{run} at step {STEPS}")
        verdict = _verdict(exporter, run)
        assert verdict["status"] == "critical", verdict
        evidence = verdict["evidence"]
        assert [e["rank"] for e in evidence["ranks"]] == [bad]
        assert evidence["ranks"][0]["device"] == f"node0:{bad}"
        assert (evidence["step"], evidence["parameters"], evidence["majority"]) == (
            FIRST_SEEN,
            [param],
            True,
        )
        assert "restore from the last checkpoint" in verdict["summary"]
        diverged = (STEPS // EVERY) - (FIRST_SEEN // EVERY) + 1
        counted = _samples(exporter, "ampscope_replica_checks_total", run, "rank", "result")
        for rank in range(RANKS):
            assert counted[(str(rank), "diverged")] == diverged
            assert counted[(str(rank), "agree")] == len(checks) - diverged
        offences = _samples(exporter, "ampscope_device_offences_total", run, "device", "kind")
        assert {k: v for k, v in offences.items() if k[1] == "replica_divergence"} == {
            (f"node0:{bad}", "replica_divergence"): diverged
        }

    # HSDP 2 x 2: rank 3's group is (1, 3); ranks 0 and 2 compare among themselves.
    bad, param = HSDP_FLIP
    for rank, out in enumerate(results):
        for step, check in out["hsdp"]["checks"]:
            if rank in (1, 3) and step >= FIRST_SEEN:
                assert not check["agree"], (rank, check)
                assert check["ranks"] == [1, 3], (rank, check)
                assert not check["majority"]
                assert check["parameters"] == [param]
                assert check["replicas"] == 2
            else:
                assert check["agree"], (rank, step)
    run = "replicas-hsdp"
    wait_until(lambda: _finished(exporter, run, STEPS), f"{run} at step {STEPS}")
    verdict = _verdict(exporter, run)
    assert verdict["status"] == "critical"
    assert [e["rank"] for e in verdict["evidence"]["ranks"]] == [1, 3]
    assert verdict["evidence"]["majority"] is False
    assert "no majority" in verdict["summary"]
    offences = _samples(exporter, "ampscope_device_offences_total", run, "device", "kind")
    assert not any(k[1] == "replica_divergence" for k in offences)  # nobody to blame

    # FSDP1 HYBRID_SHARD: rank 2's inter-node group is (0, 2); the name is the original one.
    for rank, out in enumerate(results):
        assert [step for step, _ in out["fsdp1-hybrid"]["checks"]] == checks
        for step, check in out["fsdp1-hybrid"]["checks"]:
            if rank in (0, 2) and step >= FIRST_SEEN:
                assert check["ranks"] == [0, 2], (rank, check)
                assert check["parameters"] == [FSDP1_FLIP[1]]
                assert not check["majority"]
            else:
                assert check["agree"], (rank, step)

    shown = run_status(run, url=exporter)
    assert shown.returncode == 2, shown.stderr  # critical
    assert "replica_divergence" in shown.stdout

    # 300 clean iterations (dropout, fp16 backoffs), every one checked: never diverged.
    for out in results:
        assert out["clean"]["skipped"] > 0  # the scale backed off from its warm-up height
        assert len(out["clean"]["checks"]) == CLEAN_STEPS
        assert all(check["agree"] for _, check in out["clean"]["checks"])
    run = "replicas-clean"
    wait_until(lambda: _finished(exporter, run, CLEAN_STEPS), f"{run} at step {CLEAN_STEPS}")
    assert _verdict(exporter, run)["status"] == "ok"
    counted = _samples(exporter, "ampscope_replica_checks_total", run, "rank", "result")
    assert counted == {(str(r), "agree"): float(CLEAN_STEPS) for r in range(RANKS)}
    offences = _samples(exporter, "ampscope_device_offences_total", run, "device", "kind")
    assert not any(k[1] == "replica_divergence" for k in offences)
