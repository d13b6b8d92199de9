"""DeepSpeed on one CUDA rank (ZeRO-2, nccl): bf16 and real fp16 (no override needed on a
GPU), the same assertions as the CPU tests, and the fp16 warm-up's backoffs as weather.

Skips without CUDA (and without DeepSpeed outside CI). Run alone::

    python -m pytest tests/integrations/test_deepspeed_cuda.py -q
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from deepspeed_workers import CUDA_FP16, CUDA_NAN_STEP, CUDA_STEPS, PARAMS, cuda_run
from support import need_module, run_distributed

need_module("deepspeed")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check(result: dict[str, Any], plain: dict[str, Any], mode: str, dtype: str) -> None:
    records, seen = result["records"], result["seen"]
    assert result["weights"] == plain["weights"]  # observe-only, bit for bit
    assert [r["step"] for r in records] == list(range(1, CUDA_STEPS + 1))
    assert [r["skipped"] for r in records] == [not s["applied"] for s in seen]
    assert [r["found_inf_global"] for r in records] == [s["overflow"] for s in seen]
    assert {(r["setup"]["mode"], r["setup"]["grad_dtype"]) for r in records} == {(mode, dtype)}
    nan = records[CUDA_NAN_STEP - 1]
    assert nan["skipped"]
    assert nan["found_inf_origin"] == {"cuda:0": True}
    assert {p["name"] for p in nan["nonfinite_params"]} == set(PARAMS)
    for record in records:
        norm = record["stats"]["grad_norm"]
        assert (norm is None) == record["found_inf_global"]
        assert norm is None or math.isfinite(norm)


def test_zero2_bf16_and_fp16_on_cuda() -> None:
    (result,) = run_distributed(
        cuda_run, 1, backend="nccl", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, timeout=600
    )
    _check(result["bf16"], result["bf16_plain"], "watch", "bfloat16")
    bf16 = result["bf16"]["records"]
    assert [r["skipped"] for r in bf16] == [s == CUDA_NAN_STEP for s in range(1, CUDA_STEPS + 1)]

    _check(result["fp16"], result["fp16_plain"], "scaler", "float16")
    fp16, seen = result["fp16"]["records"], result["fp16"]["seen"]
    scales = [2.0 ** CUDA_FP16["initial_scale_power"]] + [s["scale"] for s in seen]
    assert [r["scale_before"] for r in fp16] == scales[:-1]
    assert [r["scale_after"] for r in fp16] == scales[1:]
    # The warm-up: backoffs from 2**20 until the gradients fit, then clean steps.
    first_clean = next(r["step"] for r in fp16 if not r["skipped"])
    assert 1 < first_clean < CUDA_NAN_STEP
    for record in fp16[: first_clean - 1]:
        assert record["event"] == "backoff"
        assert record["scale_after"] < record["scale_before"]
        # The fault rule's call: the scaler's weather.
        assert record["nonfinite"]["kind"] == "weather", record
    assert all(not r["skipped"] for r in fp16[first_clean - 1 : CUDA_NAN_STEP - 1])
