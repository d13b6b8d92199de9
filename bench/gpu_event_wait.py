"""How much CPU ampscope's telemetry thread burns waiting for each step's host copy.

The thread waits on the CUDA event recorded after the copy. With a default event CUDA's
automatic schedule spins the waiting thread (few contexts per core); with a
blocking-sync event (``torch.cuda.Event(blocking=True)``, what
:func:`ampscope.rank.capture.pending.to_host_async` records) it sleeps. Both are timed on the
same training loop: steps queued without a host sync in between (fused AdamW, so the
host runs ahead of the device as far as it can) and with torch's per-step ``.item()``
(foreach AdamW). The ``spinning`` contender swaps in the default event for the run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bench.gpu_costs import telemetry_cpu_seconds
from bench.gpu_setups import iteration, make_setup, synchronize


def _spinning_to_host_async(
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``to_host_async`` with a default (spin-waited) event, as ampscope recorded it before."""
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@contextlib.contextmanager
def _event_kind(kind: str) -> Iterator[None]:
    # Both callers look the function up in its own module at call time.
    from ampscope.rank.capture import pending as capture

    if kind == "blocking":
        yield
        return
    original = capture.to_host_async
    capture.to_host_async = _spinning_to_host_async
    try:
        yield
    finally:
        capture.to_host_async = original


def event_wait_cost(
    base: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    device: torch.device,
    steps: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """Telemetry-thread CPU and wall time per step, spinning vs blocking event (CUDA)."""
    rows = []
    for fused in (True, False):
        for kind in ("spinning", "blocking"):
            with _event_kind(kind):
                setup = make_setup(
                    kind, base, device=device, controller="ampscope", precision="fp16", fused=fused
                )
                try:
                    for _ in range(warmup):
                        iteration(setup, inputs)
                    synchronize(device)
                    cpu_before = telemetry_cpu_seconds(setup) or 0.0
                    start = time.perf_counter()
                    for _ in range(steps):
                        iteration(setup, inputs)
                    synchronize(device)
                    wall = (time.perf_counter() - start) / steps
                    # Let the thread drain what is pending, as it would between steps.
                    setup.controller.telemetry.snapshot()
                    cpu = ((telemetry_cpu_seconds(setup) or 0.0) - cpu_before) / steps
                finally:
                    setup.close()
            rows.append(
                {
                    "event": kind,
                    "fused": fused,
                    "step_s": wall,
                    "telemetry_cpu_s_per_step": cpu,
                    "telemetry_cpu_share_of_step": cpu / wall,
                }
            )
    return rows
