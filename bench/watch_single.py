"""The GradWatch's cost per iteration on the training thread, next to the plain loop.

A bf16/fp32 loop without ampscope calls ``optimizer.step()``; with a watch it calls
``watch.step(optimizer)`` and ``watch.update()``. The difference is the watch's work on
the training thread: the fused non-finite check, the policy, the pending record. Timed
as the scalers' per-update cost is (:func:`bench.scaler_single.update_cost`): contenders
interleaved block by block, the extra cost paired per block group, wall clock and the
training thread's CPU time. On CUDA it also counts host-device syncs per iteration
(``torch.cuda.set_sync_debug_mode("warn")``), for the plain loop and each policy.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.ab import compare_groups, run_interleaved
from bench.config import ScalerBenchConfig
from bench.scaler_single import UPDATE_BLOCK, _paired
from bench.workload import Variant, build_model, make_variant

POLICIES = ("observe", "skip")
"""``raise`` does on a clean iteration exactly what ``skip`` does."""
SYNC_ITERATIONS = 20
_STATS_PAIR = ("watch_observe_stats_off", "watch_observe")


def _watch(policy: str, stats: bool = True) -> Any:
    from ampscope import GradWatch

    return GradWatch(policy, reporter=None, run_id="bench-watch", stats=stats)  # type: ignore[arg-type]


def _stepper(variant: Variant) -> Callable[[], None]:
    """The part of an iteration a watch changes: plain ``optimizer.step()``, or the
    watch's ``step()`` and ``update()``."""
    if variant.scaler is None:
        return variant.optimizer.step

    def watched() -> None:
        variant.scaler.step(variant.optimizer)
        variant.scaler.update()

    return watched


def _syncs(variant: Variant, backward: Callable[[Variant], object]) -> float:
    """Host-device syncs per iteration that torch's sync debug mode reports (CUDA)."""
    step = _stepper(variant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(SYNC_ITERATIONS):
                variant.optimizer.zero_grad(set_to_none=True)
                backward(variant)
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs) / SYNC_ITERATIONS


def _measure(
    model: nn.Module, inputs: torch.Tensor, *, per_block: int, groups: int
) -> dict[str, Any]:
    device = inputs.device
    variants = [make_variant("plain", model, None)]
    variants += [make_variant(f"watch_{p}", model, _watch(p)) for p in POLICIES]
    # observe without the loss and gradient norms: what the norm pass costs.
    variants.append(make_variant("watch_observe_stats_off", model, _watch("observe", False)))
    for v in variants[1:]:
        v.scaler.attach(v.model)
    dtype = torch.bfloat16

    def backward(variant: Variant) -> tuple[float, float]:
        """Forward and backward; returns the (wall, thread CPU) seconds of the watch's
        ``scale(loss)``, which keeps the loss for the record's stats."""
        with torch.autocast(device_type=device.type, dtype=dtype):
            loss = variant.model(inputs).float().square().mean()
        if variant.scaler is None:
            loss.backward()
            return 0.0, 0.0
        start, start_cpu = time.perf_counter(), time.thread_time()
        scaled = variant.scaler.scale(loss)
        spent = time.perf_counter() - start, time.thread_time() - start_cpu
        scaled.backward()
        return spent

    cpu: dict[str, list[list[float]]] = {v.name: [] for v in variants}

    def block(variant: Variant) -> list[float]:
        step = _stepper(variant)
        times: list[float] = []
        cpu[variant.name].append([])
        for _ in range(per_block):
            variant.optimizer.zero_grad(set_to_none=True)
            scale_wall, scale_cpu = backward(variant)
            if device.type == "cuda":
                torch.cuda.synchronize()  # time the host side of the step alone
            start, start_cpu = time.perf_counter(), time.thread_time()
            step()
            times.append(time.perf_counter() - start + scale_wall)
            cpu[variant.name][-1].append(time.thread_time() - start_cpu + scale_cpu)
        return times

    try:
        for v in variants:
            block(v)  # warm-up
        for samples in cpu.values():
            samples.clear()
        blocks = run_interleaved({v.name: v for v in variants}, block, groups=groups)
        syncs = {v.name: _syncs(v, backward) for v in variants} if device.type == "cuda" else None
        records = {v.name: v.scaler.telemetry.snapshot().steps for v in variants[1:]}
    finally:
        for v in variants:
            v.close()
    result = compare_groups(blocks, baseline="plain", unit_scale=1e6)
    wall = _paired(
        {n: [statistics.median(b) * 1e6 for b in bs] for n, bs in blocks.items()}, "plain"
    )
    thread = _paired(
        {n: [statistics.median(b) * 1e6 for b in bs] for n, bs in cpu.items()}, "plain"
    )
    return {
        "parameter_tensors": len(list(model.parameters())),
        "step_us": {n: s["median"] for n, s in result["samples"].items()},
        "extra_us": {n: d["median"] for n, d in wall.items()},
        "extra_us_iqr": {n: (d["p25"], d["p75"]) for n, d in wall.items()},
        "extra_cpu_us": {n: d["median"] for n, d in thread.items()},
        "extra_cpu_us_iqr": {n: (d["p25"], d["p75"]) for n, d in thread.items()},
        # observe with stats minus observe without, paired per block group.
        "stats_extra_us": _paired(
            {n: [statistics.median(b) * 1e6 for b in blocks[n]] for n in _STATS_PAIR},
            "watch_observe_stats_off",
        )["watch_observe"],
        "stats_extra_cpu_us": _paired(
            {n: [statistics.median(b) * 1e6 for b in cpu[n]] for n in _STATS_PAIR},
            "watch_observe_stats_off",
        )["watch_observe"],
        "syncs_per_iteration": syncs,
        "records": records,
        "warmup_iterations": per_block,
        "groups": groups,
        "iterations_per_contender": result["samples"]["plain"]["n"],
    }


def watch_cost(config: ScalerBenchConfig, *, device: str) -> dict[str, Any]:
    """The watch's extra training-thread time per iteration, plain loop vs each policy,
    on a 16x16 Linear (2 parameter tensors: the fixed cost) and on the benchmark MLP
    (the per-tensor cost of the check). Cost: ``micro_iterations`` tiny iterations and
    about half the step-time comparison's training steps, per contender.
    """
    tiny = nn.Linear(16, 16).to(device)
    per_block = min(UPDATE_BLOCK, max(5, config.micro_iterations // 6))
    # Multiples of 8 groups: each of the 4 contenders takes every position equally often.
    groups = max(8, config.micro_iterations // per_block // 8 * 8)
    mlp = build_model(width=config.width, depth=config.depth).to(device)
    return {
        "device": device,
        "tiny": _measure(
            tiny, torch.randn(4, 16, device=device), per_block=per_block, groups=groups
        ),
        "mlp": _measure(
            mlp,
            torch.randn(config.batch, config.width, device=device),
            per_block=config.steps_per_block,
            groups=max(8, config.groups // 16 * 8),
        ),
    }
