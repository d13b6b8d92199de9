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
        # Without the loss and gradient norms (stats=False): what the norm pass costs.
        make_variant(
            "ampscope_stats_off",
            model,
            ampscope_scaler(device, url=None, run_id="bench-nr", stats=False),
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
    stats_pair = {k: blocks[k] for k in ("ampscope_stats_off", "ampscope_no_reporter")}
    result["stats_vs_off"] = compare_groups(stats_pair, baseline="ampscope_stats_off")["ratio"][
        "ampscope_no_reporter"
    ]
    result["reported_updates"] = config.warmup_steps + config.groups * config.steps_per_block
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["parameter_tensors"] = len(list(model.parameters()))
    return result


def _timed_step_update(
    variant: Variant, cpu: list[float] | None = None, *, before: tuple[float, float] = (0.0, 0.0)
) -> float:
    """Seconds of ``step()`` + ``update()``, plus ``before`` (wall, thread CPU) already
    timed in the iteration (its ``scale()``)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    variant.scaler.step(variant.optimizer)
    variant.scaler.update()
    elapsed = time.perf_counter() - start + before[0]
    if cpu is not None:
        cpu.append(time.thread_time() - start_cpu + before[1])
    return elapsed


def _timed_scale(variant: Variant, loss: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
    """``scaler.scale(loss)`` and its (wall, thread CPU) seconds."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    scaled = variant.scaler.scale(loss)
    return scaled, (time.perf_counter() - start, time.thread_time() - start_cpu)


def _thread_cpu_seconds(prefix: str) -> float:
    """CPU time so far of this process's live threads whose name starts with ``prefix``."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):  # it ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


_STATS_PAIR = ("ampscope_stats_off", "ampscope_no_reporter")


def _telemetry_thread_cpu(variant: Variant) -> float:
    """CPU time so far of ``variant``'s scaler's telemetry thread (0 before it started)."""
    thread = variant.scaler.telemetry._thread
    if thread is None or thread.ident is None:
        return 0.0
    with contextlib.suppress(OSError, ProcessLookupError):
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return 0.0


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
    """The scaler's own cost per iteration: ``scale()`` + ``step()`` + ``update()`` on a
    tiny model, with the loss and gradient norms (the default) and without (``stats=False``).

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
            "ampscope_stats_off",
            model,
            ampscope_scaler(device, url=None, run_id="bench-micro", stats=False),
        ),
        make_variant(
            "ampscope_reporter", model, ampscope_scaler(device, url=url, run_id="bench-micro")
        ),
    ]
    per_block = min(UPDATE_BLOCK, max(5, config.micro_iterations // 6))
    # A multiple of 2 x contenders groups: every contender takes every position equally often.
    period = 2 * len(variants)
    groups = max(period, config.micro_iterations // per_block // period * period)
    cpu: dict[str, list[list[float]]] = {v.name: [] for v in variants}

    def block(variant: Variant) -> list[float]:
        times: list[float] = []
        cpu[variant.name].append([])
        for _ in range(per_block):
            variant.optimizer.zero_grad(set_to_none=True)
            scaled, before = _timed_scale(variant, variant.model(inputs).square().mean())
            scaled.backward()
            times.append(_timed_step_update(variant, cpu[variant.name][-1], before=before))
        return times

    try:
        for v in variants:
            block(v)  # warm-up
        for samples in cpu.values():
            samples.clear()
        telemetry_cpu = {v.name: _telemetry_thread_cpu(v) for v in variants[1:]}
        reporter_cpu = _thread_cpu_seconds("ampscope-reporter")
        blocks = run_interleaved({v.name: v for v in variants}, block, groups=groups)
        for v in variants[1:]:
            v.scaler.telemetry.snapshot()  # every record built
        # The reporter sends every flush_interval (0.5 s): let it encode and send the rest
        # while its thread is alive to be measured.
        time.sleep(1.5)
        telemetry_cpu = {
            n: _telemetry_thread_cpu(v) - telemetry_cpu[n]
            for n, v in ((v.name, v) for v in variants[1:])
        }
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
        # Telemetry threads of the ampscope contenders with stats, per record they built; the
        # reporter's sender thread per record it encoded and sent.
        "telemetry_thread_cpu_us_per_record": (
            telemetry_cpu["ampscope_no_reporter"] + telemetry_cpu["ampscope_reporter"]
        )
        / (2 * timed)
        * 1e6,
        "telemetry_thread_cpu_us_per_record_stats_off": telemetry_cpu["ampscope_stats_off"]
        / timed
        * 1e6,
        "reporter_thread_cpu_us_per_record": reporter_cpu / timed * 1e6,
        "step_update_us": {n: s["median"] for n, s in result["samples"].items()},
        "extra_us": {n: d["median"] for n, d in wall.items()},
        "extra_us_iqr": {n: (d["p25"], d["p75"]) for n, d in wall.items()},
        "ratio": {n: r["median"] for n, r in result["ratio"].items()},
        # The stats' own cost: stats on minus stats off, both without a reporter, paired.
        "stats_extra_us": _paired(
            {n: [statistics.median(b) * 1e6 for b in blocks[n]] for n in _STATS_PAIR},
            "ampscope_stats_off",
        )["ampscope_no_reporter"],
        "stats_extra_cpu_us": _paired(
            {n: [statistics.median(b) * 1e6 for b in cpu[n]] for n in _STATS_PAIR},
            "ampscope_stats_off",
        )["ampscope_no_reporter"],
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
