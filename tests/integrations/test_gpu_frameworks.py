"""OLMo-core and torchtitan on a GPU, with none of the CPU launchers' patches.

One rank on NCCL (one GPU cannot host two NCCL ranks); the same runs as the two-rank CPU
tests (stock and ``observe`` clean, ``skip`` and ``raise`` with a NaN planted in this
rank's gradient at a known step), in each framework's deterministic setting so that the
observed run can be compared with the stock one bit for bit. Skips without CUDA (CI has
none); run on the GPU machine (see docs/performance.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TIMEOUT_S = 600.0
"""Deadlock guard: four framework runs in one spawned rank."""


def _deterministic() -> None:
    # cuBLAS needs a fixed workspace to be deterministic (torch's documented setting).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


RUNS = {"stock": None, "observe": "observe", "skip": "skip", "raise": "raise"}
"""The four runs, by name: their policy (``None``: without ampscope)."""


def _four_runs(run: Any, rank: int, world_size: int, *args: str) -> dict[str, Any]:
    """``run`` (a framework's ``olmo_run``/``titan_run``) once per entry of :data:`RUNS`,
    on the GPU, with this one rank's gradient poisoned under ``skip`` and ``raise``."""
    return {
        name: run(
            rank,
            world_size,
            policy,
            *args,
            inject=name in ("skip", "raise"),
            device="cuda",
            inject_rank=0,
        )
        for name, policy in RUNS.items()
    }


def olmo_gpu_worker(rank: int, world_size: int, run_id: str, work_dir: str) -> dict[str, Any]:
    from olmo_core_workers import olmo_run

    _deterministic()
    return _four_runs(olmo_run, rank, world_size, run_id, work_dir)


def titan_gpu_worker(rank: int, world_size: int, run_id: str, dump: str) -> dict[str, Any]:
    from torchtitan_workers import titan_run

    # torchtitan's own --debug.deterministic (torchtitan_workers.argv on the GPU).
    return _four_runs(titan_run, rank, world_size, run_id, dump)


def _check(result: dict[str, Any], steps: int, inject_step: int) -> None:
    stock, observe, skip, stop = (result[k] for k in ("stock", "observe", "skip", "raise"))
    assert stock["error"] is None
    assert observe["error"] is None
    assert observe["bits"] == stock["bits"]  # observing changes no bit of the training
    assert observe["skipped"] == observe["found"] == [False] * steps
    assert all(norm is not None and norm > 0 for norm in observe["grad_norm"])
    at_inject = [step == inject_step for step in range(1, steps + 1)]
    assert skip["error"] is None
    assert skip["finite"]
    # One rank: its local gradients are the job's; origin tracking has nothing to compare.
    assert skip["skipped"] == skip["found"] == at_inject
    assert skip["optimizer_steps"] == [steps - 1]
    assert stop["error"] is not None
    assert stop["error"].startswith("NonFiniteGradientsError: ")
    assert f"at step {inject_step}" in stop["error"]
    assert stop["optimizer_steps"] == [inject_step - 1]


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_olmo_core_on_the_gpu(tmp_path: Path) -> None:
    pytest.importorskip("olmo_core")
    from olmo_core_workers import INJECT_STEP, STEPS

    (result,) = run_distributed(
        olmo_gpu_worker, 1, args=("olmo-gpu", str(tmp_path)), timeout=TIMEOUT_S, backend="nccl"
    )
    _check(result, STEPS, INJECT_STEP)
    assert result["observe"]["step_is_class_method"]


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_torchtitan_on_the_gpu(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan_workers import INJECT_STEP, STEPS

    (result,) = run_distributed(
        titan_gpu_worker, 1, args=("titan-gpu", str(tmp_path)), timeout=TIMEOUT_S, backend="nccl"
    )
    _check(result, STEPS, INJECT_STEP)
    assert result["observe"]["schedulers_class"] == "WatchedLRSchedulers"
    assert result["observe"]["step_restored"]
