"""Scaler overhead in one process: step-time A/B, per-update cost, overflow attribution.

All three interleave the contenders block by block (:mod:`bench.ab`), so machine drift
and other load on the host spread evenly over them.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from typing import Any

import torch
from torch import nn

from bench.ab import compare_groups, run_interleaved
from bench.config import ScalerBenchConfig
from bench.stats import quantile
from bench.workload import (
    Variant,
    ampscope_scaler,
    build_model,
    make_variant,
    stock_scaler,
    train_step,
)


def autocast_dtype(device: str) -> torch.dtype | None:
    """fp16 autocast on CUDA, what loss scaling exists for; fp32 on the CPU.

    CPU fp16 matmuls are emulated and slow; the scaler does the same work either way.
    """
    return torch.float16 if device == "cuda" else None


def _close_all(variants: list[Variant]) -> None:
    for v in variants:
        v.close()


def step_time_ab(config: ScalerBenchConfig, *, device: str, url: str) -> dict[str, Any]:
    """Full training steps: torch's stock scaler vs ampscope, without and with its reporter.

    Cost: ``3 * groups * steps_per_block`` training steps plus warm-up.
    """
    model = build_model(width=config.width, depth=config.depth).to(device)
    inputs = torch.randn(config.batch, config.width, device=device)
    targets = torch.randn(config.batch, config.width, device=device)
    variants = [
        make_variant("stock", model, stock_scaler(device)),
        # Without a reporter: the scaler's own work, apart from sending records.
        make_variant(
            "ampscope_no_reporter", model, ampscope_scaler(device, url=None, run_id="bench-nr")
        ),
        make_variant("ampscope", model, ampscope_scaler(device, url=url, run_id="bench-single")),
    ]
    for v in variants[1:]:
        v.scaler.attach(v.model)
    dtype = autocast_dtype(device)

    def block(variant: Variant) -> list[float]:
        return [
            train_step(variant, inputs, targets, autocast_dtype=dtype)
            for _ in range(config.steps_per_block)
        ]

    try:
        for v in variants:
            for _ in range(config.warmup_steps):
                train_step(v, inputs, targets, autocast_dtype=dtype)
        blocks = run_interleaved({v.name: v for v in variants}, block, groups=config.groups)
    finally:
        _close_all(variants)
    result = compare_groups(blocks, baseline="stock")
    result["reported_updates"] = config.warmup_steps + config.groups * config.steps_per_block
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["parameter_tensors"] = len(list(model.parameters()))
    return result


def _timed_step_update(variant: Variant, cpu: list[float] | None = None) -> float:
    start, start_cpu = time.perf_counter(), time.thread_time()
    variant.scaler.step(variant.optimizer)
    variant.scaler.update()
    elapsed = time.perf_counter() - start
    if cpu is not None:
        cpu.append(time.thread_time() - start_cpu)
    return elapsed


def _thread_cpu_seconds(prefix: str) -> float:
    """CPU time so far of this process's live threads whose name starts with ``prefix``."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):  # it ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


UPDATE_BLOCK = 250
"""Iterations per block of the per-update comparison."""


def _paired(per_block: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Per contender: median and quartiles over block groups of (its block median minus the
    baseline's block median in the same group): drift between groups cancels."""
    out = {}
    for name, medians in per_block.items():
        if name == baseline:
            continue
        deltas = [a - b for a, b in zip(medians, per_block[baseline], strict=True)]
        out[name] = {
            "median": statistics.median(deltas),
            "p25": quantile(deltas, 0.25),
            "p75": quantile(deltas, 0.75),
        }
    return out


def update_cost(config: ScalerBenchConfig, *, device: str, url: str) -> dict[str, Any]:
    """The scaler's own cost per iteration: ``step()`` + ``update()`` on a tiny model.

    The tiny model (one 16x16 Linear) makes the optimizer's share negligible, so the
    difference to the stock scaler is ampscope's extra work on the training thread. Work
    on ampscope's background thread (records, HTTP) reaches this clock only through the
    GIL; the ``ampscope_reporter`` contender includes that at an unrealistically high
    record rate (one record per ~0.5 ms instead of one per training step). The extra cost
    is paired: per block group, a contender's block median minus stock's.
    """
    model = nn.Linear(16, 16).to(device)
    inputs = torch.randn(4, 16, device=device)
    variants = [
        make_variant("stock", model, stock_scaler(device)),
        make_variant(
            "ampscope_no_reporter", model, ampscope_scaler(device, url=None, run_id="bench-micro")
        ),
        make_variant(
            "ampscope_reporter", model, ampscope_scaler(device, url=url, run_id="bench-micro")
        ),
    ]
    per_block = min(UPDATE_BLOCK, max(5, config.micro_iterations // 6))
    # A multiple of 6 groups: every contender takes every position equally often.
    groups = max(6, config.micro_iterations // per_block // 6 * 6)
    cpu: dict[str, list[list[float]]] = {v.name: [] for v in variants}

    def block(variant: Variant) -> list[float]:
        times: list[float] = []
        cpu[variant.name].append([])
        for _ in range(per_block):
            variant.optimizer.zero_grad(set_to_none=True)
            variant.scaler.scale(variant.model(inputs).square().mean()).backward()
            times.append(_timed_step_update(variant, cpu[variant.name][-1]))
        return times

    try:
        for v in variants:
            block(v)  # warm-up
        for samples in cpu.values():
            samples.clear()
        telemetry_cpu = _thread_cpu_seconds("ampscope-telemetry")
        reporter_cpu = _thread_cpu_seconds("ampscope-reporter")
        blocks = run_interleaved({v.name: v for v in variants}, block, groups=groups)
        for v in variants[1:]:
            v.scaler.telemetry.snapshot()  # every record built
        # The reporter sends every flush_interval (0.5 s): let it encode and send the rest
        # while its thread is alive to be measured.
        time.sleep(1.5)
        telemetry_cpu = _thread_cpu_seconds("ampscope-telemetry") - telemetry_cpu
        reporter_cpu = _thread_cpu_seconds("ampscope-reporter") - reporter_cpu
    finally:
        _close_all(variants)
    result = compare_groups(blocks, baseline="stock", unit_scale=1e6)
    timed = per_block * groups
    wall = _paired(
        {n: [statistics.median(b) * 1e6 for b in bs] for n, bs in blocks.items()}, "stock"
    )
    thread = _paired(
        {n: [statistics.median(b) * 1e6 for b in bs] for n, bs in cpu.items()}, "stock"
    )
    cpu_us = {
        name: statistics.median([s for b in blocks_ for s in b]) * 1e6
        for name, blocks_ in cpu.items()
    }
    return {
        # Thread CPU time of the training thread: what other processes on the host do
        # not move, unlike the wall clock (a GIL wait is not CPU time; see extra_us).
        "step_update_cpu_us": cpu_us,
        "extra_cpu_us": {n: d["median"] for n, d in thread.items()},
        "extra_cpu_us_iqr": {n: (d["p25"], d["p75"]) for n, d in thread.items()},
        # Telemetry threads of both ampscope contenders, per record they built; the
        # reporter's sender thread per record it encoded and sent.
        "telemetry_thread_cpu_us_per_record": telemetry_cpu / (2 * timed) * 1e6,
        "reporter_thread_cpu_us_per_record": reporter_cpu / timed * 1e6,
        "step_update_us": {n: s["median"] for n, s in result["samples"].items()},
        "extra_us": {n: d["median"] for n, d in wall.items()},
        "extra_us_iqr": {n: (d["p25"], d["p75"]) for n, d in wall.items()},
        "ratio": {n: r["median"] for n, r in result["ratio"].items()},
        "groups": groups,
        "iterations_per_contender": result["samples"]["stock"]["n"],
        # warm-up block + timed blocks of the one contender with a reporter
        "reported_updates": per_block * (1 + groups),
    }


def overflow_cost(config: ScalerBenchConfig, *, device: str) -> dict[str, Any]:
    """``step()`` + ``update()`` on overflow iterations: attribution on vs off, and stock.

    Gradients of the benchmark model are computed once, with inf and NaN planted in two
    parameters, and restored (untimed) before each timed iteration, so every iteration
    overflows the same way; ``scale(loss)`` is called (untimed) as a real iteration
    would before its backward. The scale halves each time (2**16 down to about 2**-60 in
    the full preset), far from float32 underflow. No reporter: this isolates attribution.
    """
    model = build_model(width=config.width, depth=config.depth).to(device)
    inputs = torch.randn(config.batch, config.width, device=device)
    nn.functional.mse_loss(model(inputs), inputs).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    params = [p for p in model.parameters() if p.grad is not None]
    grads[0].view(-1)[0] = math.inf
    grads[-1].view(-1)[-1] = math.nan
    saved = [g.detach().clone() for g in grads]
    loss = torch.ones((), device=device)

    def make(name: str, scaler: Any) -> Variant:
        # The contenders share the model: overflow iterations never change the weights.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return Variant(name=name, model=model, optimizer=opt, scaler=scaler)

    variants = [
        make("stock", stock_scaler(device)),
        make("attribution_off", ampscope_scaler(device, url=None, run_id="b", attribution=False)),
        make("attribution_on", ampscope_scaler(device, url=None, run_id="b", attribution=True)),
    ]
    variants[2].scaler.attach(model)
    groups = 2 * len(variants)
    per_block = max(2, config.overflow_iterations // groups)
    backoffs = {v.name: 0 for v in variants}

    def block(variant: Variant) -> list[float]:
        times = []
        for _ in range(per_block):
            with torch.no_grad():
                for p, g in zip(params, saved, strict=True):
                    p.grad = g.clone()
            variant.scaler.scale(loss)  # as in a real iteration, before the backward
            before = variant.scaler.get_scale()
            times.append(_timed_step_update(variant))
            backoffs[variant.name] += int(variant.scaler.get_scale() < before)
        return times

    try:
        for v in variants:
            block(v)
        blocks = run_interleaved({v.name: v for v in variants}, block, groups=groups)
    finally:
        _close_all(variants)
    result = compare_groups(blocks, baseline="stock")
    medians = {n: s["median"] for n, s in result["samples"].items()}
    return {
        "step_update_ms": medians,
        "attribution_extra_ms": medians["attribution_on"] - medians["attribution_off"],
        "ampscope_extra_ms": medians["attribution_on"] - medians["stock"],
        "backoffs": backoffs,
        "iterations_per_contender": result["samples"]["stock"]["n"],
    }
