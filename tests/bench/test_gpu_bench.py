"""``python -m bench.gpu``: the model's shape, the trace counting, a CPU dry run, and on
CUDA the proof that ampscope adds no host-device sync.

The CPU dry run checks the plumbing end to end (every section, both files written); it
times nothing. The CUDA test runs the sync section for real and asserts its verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpt import GPT, GPT2_SMALL, parameter_count
from bench.gpu import PRESETS, device_slug, main, run_syncs
from bench.gpu_profile import count_trace
from bench.gpu_setups import PHASES, ProcessGroup


def test_gpt2_small_shape_has_gpt2_small_parameter_count() -> None:
    with torch.device("meta"):
        model = GPT(GPT2_SMALL)
    # GPT-2 small with its tied output head: 124,439,808 parameters in 148 tensors.
    assert parameter_count(model) == 124_439_808
    assert len(list(model.parameters())) == 148


def test_device_slug() -> None:
    assert device_slug("NVIDIA H200") == "nvidia-h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def _runtime(name: str, tid: int, correlation: int) -> dict[str, object]:
    return {"cat": "cuda_runtime", "name": name, "tid": tid, "args": {"correlation": correlation}}


def test_count_trace_splits_threads_and_copy_destinations() -> None:
    trainer, autograd, telemetry = 11, 12, 22
    events = [
        *(_runtime("cudaLaunchKernel", trainer, c) for c in range(1, 3)),
        *(_runtime("cudaLaunchKernel", autograd, c) for c in range(3, 7)),
        _runtime("cudaMemcpyAsync", trainer, 7),
        _runtime("cudaStreamSynchronize", trainer, 8),
        _runtime("cudaMemcpyAsync", trainer, 9),
        _runtime("cudaEventSynchronize", telemetry, 10),
        _runtime("cudaMemcpyAsync", telemetry, 11),
        {
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pageable)",
            "args": {"correlation": 7},
        },
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"correlation": 9}},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"correlation": 9}},
        {"cat": "kernel", "name": "cudaStreamSynchronize", "tid": trainer},
        {"ph": "M", "name": "thread_name"},
    ]
    counts = count_trace({"traceEvents": events}, iterations=2)
    training, other = counts["launching_threads"], counts["other_threads"]
    assert training["kernel_launches"] == 3.0
    assert training["cudaStreamSynchronize"] == 0.5
    assert training["cudaEventSynchronize"] == 0.0
    assert (training["d2h_copies"], training["d2h_to_pageable"], training["d2h_to_pinned"]) == (
        1.0,
        0.5,
        0.5,
    )
    assert other["cudaEventSynchronize"] == 0.5
    assert other["kernel_launches"] == 0.0
    assert other["d2h_copies"] == 0.0
    assert counts["threads"] == 3


def test_cpu_dry_run_writes_every_section(tmp_path: Path) -> None:
    assert main(["--device", "cpu", "--preset", "quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    summary = (tmp_path / "gpu-cpu.md").read_text()
    quick = PRESETS["quick"]
    syncs = results["syncs"]
    assert len(syncs["pairs"]) == 8
    for pair in syncs["pairs"]:
        ours = pair["ampscope"]
        assert ours["strict"]["error"] is None
        assert ours["records"] == {"steps": ours["iterations_total"], "dropped": 0}
        assert ours["iterations_total"] == quick.sync_warmup + 2 * quick.sync_iterations
        assert set(pair["added_per_iteration"]) == set(PHASES)
    assert [p["baseline"]["iterations"] for p in results["profile"]["pairs"]] == [
        quick.profile_iterations
    ] * 4
    costs = results["costs"]
    for key in ("fp16_non_fused", "fp16_fused"):
        ratios = costs[key]["single_process"]["ratio"]["ampscope"]
        assert ratios["groups"] == quick.groups
        assert ratios["median"] > 0
        assert set(costs[key]["ddp"]["ratio"]) == {"ddp_ampscope", "ddp_ampscope_origin"}
    assert costs["bf16_fused"]["ratio"]["watch"]["groups"] == quick.groups
    assert all(row["stock"] is None for row in costs["memory"])  # no GPU memory on the CPU
    assert [(r["fused"], r["event"]) for r in results["event_wait"]["rows"]] == [
        (True, "spinning"),
        (True, "blocking"),
        (False, "spinning"),
        (False, "blocking"),
    ]
    assert "CPU dry run" in summary
    assert "## Costs on the GPT-2-small-shaped model" in summary


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clean_iterations_add_no_sync() -> None:
    """GradScaler, ShardedGradScaler, origin tracking and GradWatch observe, each with
    foreach and fused AdamW: no phase syncs more than stock's, the strict pass (``"error"``
    outside the scalers' ``step()``) completes, and every iteration is recorded."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with ProcessGroup(device):
        section = run_syncs(PRESETS["quick"], device)
    assert section["control_raises"] is True
    for pair in section["pairs"]:
        label = f"{pair['setup']} fused={pair['fused']}"
        ours = pair["ampscope"]
        assert ours["strict"]["error"] is None, label
        assert ours["strict"]["iterations"] == PRESETS["quick"].sync_iterations, label
        assert pair["added_per_iteration"] == dict.fromkeys(PHASES, 0.0), label
        assert ours["records"] == {"steps": ours["iterations_total"], "dropped": 0}, label
        if pair["allowed"] == []:  # the GradWatch: not even step() may sync
            assert sum(ours["census"]["per_iteration"].values()) == 0, label
