"""Two real gloo ranks, DDP and FSDP2, under GradWatch in bf16 and the fp16 GradScaler,
with torchao Float8Linear layers (emulated on the CPU), reporting to a real exporter.

Rank 1 multiplies one layer's input by 1e3 at a known step: its records show that amax
jump for that layer, tensor and rank alone, and the exporter's fp8_amax_spike names
exactly them. A separate clean run of a few hundred iterations fires no FP8 verdict.

Every setup and the clean run share one 2-rank launch (``launch_worker``): emulated FP8
on the CPU is slow, and each launch pays a process start and a torchao import.
"""

from __future__ import annotations

from typing import Any

import pytest
from fp8_setups import SETUPS, SPIKE, SPIKE_LAYER, SPIKE_STEP, launch_worker
from support import free_port, run_distributed

from ampscope.demo.exporter import ExporterProcess
from ampscope.verdicts.rollup import from_history
from ampscope.verdicts.verdict import FP8_RULES

# A deadlock guard only: emulated FP8 on a shared CPU is slow, and no verdict here
# depends on how long a step takes.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

STEPS = SPIKE_STEP + 5
CLEAN_STEPS = 200
"""The clean run: every iteration observed, so each of its 30 series has 200
observations (the spike rule judges from the 21st on)."""


@pytest.fixture(scope="module")
def launched() -> Any:
    """The one launch's results by rank, its exporter stopped afterwards."""
    exporter = ExporterProcess(free_port())
    exporter.start()
    try:
        yield run_distributed(launch_worker, args=(exporter.url, STEPS, CLEAN_STEPS), timeout=1400)
    finally:
        exporter.stop()


@pytest.mark.parametrize("setup", SETUPS)
def test_one_ranks_spike_is_named_by_layer_tensor_rank_and_step(launched, setup: str) -> None:
    results = [by_rank["spike"] for by_rank in launched]
    target = f"{SPIKE_LAYER}/input"
    for rank, result in enumerate(results):
        amax = result[setup]["amax"]
        assert len(amax) == STEPS, setup
        before = amax[SPIKE_STEP - 2]
        at = amax[SPIKE_STEP - 1]
        for key, value in at.items():
            assert value is not None, (setup, rank, key)
            ratio = value / before[key]
            if rank == 1 and key == target:
                assert ratio > SPIKE / 10, (setup, key, ratio)
            else:  # nothing else jumps, on either rank
                assert ratio < 10, (setup, rank, key, ratio)
    casts = dict(results[0][setup]["casts"])
    assert casts["weight"] == ("fsdp_all_gather" if setup.startswith("fsdp2") else "output_gemm")
    verdicts = results[0][setup]["health"]
    # The run finished normally: the spike reads as history, as judged before.
    spike = from_history(verdicts["fp8_amax_spike"])
    assert spike["status"] == "warning", (setup, spike)
    assert spike["evidence"]["series_affected"] == 1
    (named,) = spike["evidence"]["series"]
    assert (named["rank"], named["layer"], named["tensor"], named["step"]) == (
        1,
        SPIKE_LAYER,
        "input",
        SPIKE_STEP,
    )
    assert named["value"] / named["baseline"] > SPIKE / 10
    assert verdicts["fp8_nonfinite_amax"]["status"] == "ok"


def test_a_clean_run_fires_no_fp8_verdict(launched) -> None:
    results = [by_rank["clean"] for by_rank in launched]
    assert [r["steps"] for r in results] == [CLEAN_STEPS, CLEAN_STEPS]
    verdicts = results[0]["health"]
    for rule in FP8_RULES:
        assert verdicts[rule]["status"] == "ok", verdicts[rule]
    assert verdicts["fp8_amax_spike"]["evidence"]["series"] == 2 * 15
