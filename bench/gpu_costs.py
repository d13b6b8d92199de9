"""What ampscope costs on the GPT-2-shaped model: step time, paired A/B, and peak memory.

**Step time.** Each family of setups (same precision and optimizer) runs interleaved in
blocks (:mod:`bench.ab`); a step's time is the device's time between two events recorded
around it on the stream (on the CPU, the host clock), so host work hidden behind queued
device work costs nothing and host work that starves the device shows in full, as in
real training. The ratio is the median over block groups of each contender's block median
over the baseline's in the same group; origin tracking's cost is the paired difference of
block medians (DDP with origin tracking minus DDP with ampscope alone).

**Telemetry thread.** The CPU time ampscope's telemetry thread spent per step in each
family (it waits for each step's host copy on a CUDA event): work off the training
thread, on a core of its own.

**Memory.** Each setup alone on the device: peak bytes allocated above what was allocated
before its model was copied over, over a few iterations (the optimizer's state included),
and the bytes still allocated after them. ampscope's minus stock's is what it adds.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.ab import compare_groups, run_interleaved
from bench.gpu_setups import Setup, iteration, make_setup, synchronize
from bench.stats import quantile

Spec = tuple[str, str, str]
"""(contender name, controller, wrap): see :func:`bench.gpu_setups.make_setup`."""

FP16_SPECS: tuple[Spec, ...] = (
    ("stock", "stock", "none"),
    ("ampscope", "ampscope", "none"),
    ("ddp_stock", "stock", "ddp"),
    ("ddp_ampscope", "ampscope", "ddp"),
    ("ddp_ampscope_origin", "ampscope_origin", "ddp"),
)
REPORTER_SPEC: Spec = ("ampscope_reporter", "ampscope_reporter", "none")
BF16_SPECS: tuple[Spec, ...] = (("plain", "plain", "none"), ("watch", "watch", "none"))
CLIP_SPECS: tuple[Spec, ...] = (
    ("stock_clip", "stock_clip", "none"),
    ("ampscope_clip", "ampscope_clip", "none"),
)
"""fp16 loops that clip after ``unscale_``: ampscope through its ``clip_grad_norm_``."""


def _timed_block(setup: Setup, inputs: tuple[torch.Tensor, ...], steps: int) -> list[float]:
    """Seconds per step over ``steps`` steps: device events on CUDA, the host clock on
    the CPU. One synchronize at the end of the block, none between steps."""
    if setup.device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            iteration(setup, inputs)
            times.append(time.perf_counter() - start)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        iteration(setup, inputs)
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]


def paired_difference(
    blocks: dict[str, list[list[float]]], name: str, baseline: str, *, unit_scale: float = 1e3
) -> dict[str, float]:
    """Median and quartiles over groups of (``name``'s block median minus ``baseline``'s),
    in ms by default."""
    deltas = [
        (statistics.median(a) - statistics.median(b)) * unit_scale
        for a, b in zip(blocks[name], blocks[baseline], strict=True)
    ]
    return {
        "median": statistics.median(deltas),
        "p25": quantile(deltas, 0.25),
        "p75": quantile(deltas, 0.75),
    }


def family_ab(
    base: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    specs: tuple[Spec, ...],
    *,
    device: torch.device,
    precision: str,
    fused: bool,
    groups: int,
    steps_per_block: int,
    warmup: int,
    url: str | None = None,
) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
    """Time every setup of one family, interleaved.

    Returns:
        Per contender, per-step seconds per block; and per ampscope contender, its
        telemetry thread's CPU seconds per step over the whole run.
    """
    setups = {
        name: make_setup(
            name,
            base,
            device=device,
            controller=controller,
            precision=precision,
            fused=fused,
            wrap=wrap,
            url=url,
        )
        for name, controller, wrap in specs
    }
    try:
        for setup in setups.values():
            for _ in range(warmup):
                iteration(setup, inputs)
        synchronize(device)
        blocks = run_interleaved(
            setups, lambda s: _timed_block(s, inputs, steps_per_block), groups=groups
        )
        steps = warmup + groups * steps_per_block
        telemetry_cpu = {
            name: seconds / steps
            for name, setup in setups.items()
            if (seconds := telemetry_cpu_seconds(setup)) is not None
        }
        return blocks, telemetry_cpu
    finally:
        for setup in setups.values():
            setup.close()
        del setups
        _release(device)


def telemetry_cpu_seconds(setup: Setup) -> float | None:
    """CPU time so far of the setup's telemetry thread; None without one."""
    telemetry = getattr(setup.controller, "telemetry", None)
    thread = getattr(telemetry, "_thread", None)
    if thread is None or thread.ident is None:
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):  # it ended meanwhile
        return None


def summarize_fp16(blocks: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Ratios against stock (single process) and DDP stock; origin tracking's paired cost."""
    single = {k: v for k, v in blocks.items() if not k.startswith("ddp_")}
    ddp = {k: v for k, v in blocks.items() if k.startswith("ddp_")}
    out = {
        "single_process": compare_groups(single, baseline="stock"),
        "ddp": compare_groups(ddp, baseline="ddp_stock"),
    }
    origin = paired_difference(blocks, "ddp_ampscope_origin", "ddp_ampscope")
    step_ms = out["ddp"]["samples"]["ddp_stock"]["median"]
    origin["share_of_step"] = origin["median"] / step_ms
    out["origin_added_ms"] = origin
    out["ampscope_added_ms"] = paired_difference(blocks, "ampscope", "stock")
    return out


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_of(
    make: Callable[[], Setup], inputs: tuple[torch.Tensor, ...], *, steps: int
) -> dict[str, int] | None:
    """Peak and resident bytes a setup adds, alone on the device (None on the CPU)."""
    probe = inputs[0].device
    if probe.type != "cuda":
        return None
    _release(probe)
    synchronize(probe)
    before = torch.cuda.memory_allocated(probe)
    torch.cuda.reset_peak_memory_stats(probe)
    setup = make()
    try:
        for _ in range(steps):
            iteration(setup, inputs)
        synchronize(probe)
        result = {
            "peak_bytes": torch.cuda.max_memory_allocated(probe) - before,
            "resident_bytes": torch.cuda.memory_allocated(probe) - before,
        }
    finally:
        setup.close()
        del setup
        _release(probe)
    return result


MEMORY_PAIRS: tuple[tuple[str, str, Spec, Spec], ...] = (
    ("GradScaler", "fp16", ("stock", "stock", "none"), ("ampscope", "ampscope", "none")),
    (
        "GradScaler + origin (DDP)",
        "fp16",
        ("ddp_stock", "stock", "ddp"),
        ("ddp_ampscope_origin", "ampscope_origin", "ddp"),
    ),
    ("GradWatch observe", "bf16", ("plain", "plain", "none"), ("watch", "watch", "none")),
)


def memory_costs(
    base: nn.Module, inputs: tuple[torch.Tensor, ...], *, device: torch.device, steps: int
) -> list[dict[str, Any]]:
    """Added peak and resident bytes for each pair of :data:`MEMORY_PAIRS`, fused or not."""
    rows = []
    for fused in (False, True):
        for label, precision, stock, ours in MEMORY_PAIRS:
            measured = {}
            for role, (name, controller, wrap) in (("stock", stock), ("ampscope", ours)):

                def make(
                    name: str = name,
                    controller: str = controller,
                    wrap: str = wrap,
                    precision: str = precision,
                    fused: bool = fused,
                ) -> Setup:
                    return make_setup(
                        name,
                        base,
                        device=device,
                        controller=controller,
                        precision=precision,
                        fused=fused,
                        wrap=wrap,
                    )

                measured[role] = memory_of(make, inputs, steps=steps)
            row: dict[str, Any] = {"setup": label, "fused": fused, **measured}
            if measured["stock"] is not None and measured["ampscope"] is not None:
                for key in ("peak_bytes", "resident_bytes"):
                    row[f"added_{key}"] = measured["ampscope"][key] - measured["stock"][key]
            rows.append(row)
    return rows
