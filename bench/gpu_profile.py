"""Synchronising CUDA calls per iteration, counted in a torch.profiler trace.

Profiles ``iterations`` iterations of a setup (CPU and CUDA activities; one
``cudaDeviceSynchronize`` at the end so the trace holds every kernel) and counts, per
iteration and per host thread, the runtime calls that make the host wait
(``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``,
synchronous ``cudaMemcpy``) and the device-to-host copies, by destination (pageable
memory: a copy the host waits for; pinned: ampscope's non-blocking copy). Threads that
launch kernels (the training thread and autograd's device thread, which runs backward)
are counted apart from threads that launch none (ampscope's telemetry thread, NCCL's
watchdog).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.gpu_setups import Setup, iteration, synchronize

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
)
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def count_trace(trace: dict[str, Any], iterations: int) -> dict[str, Any]:
    """Per-iteration counts from a Chrome trace (``export_chrome_trace``'s JSON).

    Returns ``{"launching_threads": {...}, "other_threads": {...}, "threads": n}``;
    each part holds every name of :data:`SYNC_CALLS` plus ``d2h_copies``,
    ``d2h_to_pageable``, ``d2h_to_pinned`` and ``kernel_launches``, divided by
    ``iterations``.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    launching = {e.get("tid") for e in runtime if "LaunchKernel" in e["name"]}
    thread_of = {
        e["args"]["correlation"]: e.get("tid")
        for e in runtime
        if isinstance(e.get("args"), dict) and "correlation" in e["args"]
    }
    parts = {"launching_threads": Counter[str](), "other_threads": Counter[str]()}

    def part(tid: Any) -> Counter[str]:
        return parts["launching_threads" if tid in launching else "other_threads"]

    for e in runtime:
        name = e["name"]
        if name in SYNC_CALLS:
            part(e.get("tid"))[name] += 1
        if "LaunchKernel" in name:
            part(e.get("tid"))["kernel_launches"] += 1
    for e in events:
        if e.get("cat") != "gpu_memcpy" or "DtoH" not in e.get("name", ""):
            continue
        args = e.get("args")
        correlation = args.get("correlation") if isinstance(args, dict) else None
        counter = part(thread_of.get(correlation))
        counter["d2h_copies"] += 1
        if "Pageable" in e["name"]:
            counter["d2h_to_pageable"] += 1
        elif "Pinned" in e["name"]:
            counter["d2h_to_pinned"] += 1
    keys = (*SYNC_CALLS, "d2h_copies", "d2h_to_pageable", "d2h_to_pinned", "kernel_launches")
    out: dict[str, Any] = {
        name: {k: counter[k] / iterations for k in keys} for name, counter in parts.items()
    }
    out["threads"] = len({e.get("tid") for e in runtime})
    return out


def profile_setup(
    setup: Setup, inputs: tuple[torch.Tensor, ...], *, warmup: int, iterations: int
) -> dict[str, Any]:
    """Warm up, then profile ``iterations`` iterations and count their syncs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        iteration(setup, inputs)
    synchronize(setup.device)
    activities = [ProfilerActivity.CPU]
    if setup.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            iteration(setup, inputs)
        synchronize(setup.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    counts = count_trace(trace, iterations)
    counts["iterations"] = iterations
    counts["harness"] = "one cudaDeviceSynchronize at the end, on the main thread"
    return counts
