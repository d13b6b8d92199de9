"""Host-device syncs per iteration, by phase, as torch's CUDA sync debug mode reports them.

For each setup, after warm-up iterations (first allocations, the run identity, NCCL's and
DDP's first-iteration work), two passes of clean iterations:

* **census**: ``torch.cuda.set_sync_debug_mode("warn")`` throughout; every warning is
  counted against the phase (zero_grad, forward, backward, step, update) that raised it.
* **strict**: ``"error"`` in every phase but the allowed ones, where ``"warn"`` counts
  instead. For the scalers the one allowed phase is ``step()``: torch's own ``.item()`` of
  found-inf there (none with a fused optimizer, which skips on the device). A GradWatch
  is allowed none. Any other sync raises and ends the pass; the message is kept.

The mode is global, so the telemetry thread's work during a pass falls under it too: a
sync there would drop a record, which :func:`records_of` shows. On the CPU the debug mode
does nothing and every count is zero (the dry run checks only the plumbing).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from bench.gpu_setups import PHASES, Setup, iteration, phases, synchronize

SYNC_MESSAGE = "synchronizing CUDA operation"


def _set_mode(device: torch.device, mode: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


def run_pass(
    setup: Setup,
    inputs: tuple[torch.Tensor, ...],
    iterations: int,
    *,
    allowed: Sequence[str] | None,
) -> dict[str, Any]:
    """Syncs per iteration by phase over ``iterations`` clean iterations.

    Args:
        allowed: ``None``: the census (``warn`` everywhere). Otherwise the strict pass:
            these phases under ``warn``, all others under ``error``.

    Returns:
        ``{"per_iteration": {phase: syncs}, "iterations": completed, "error": message or
        None}``; the first exception (a sync under ``error``, or anything else) ends the
        pass and is kept as its message.
    """
    counts = dict.fromkeys(PHASES, 0)
    done, error = 0, None
    synchronize(setup.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(iterations):
                for phase, call in phases(setup, inputs):
                    strict = allowed is not None and phase not in allowed
                    _set_mode(setup.device, "error" if strict else "warn")
                    seen = len(caught)
                    call()
                    counts[phase] += sum(SYNC_MESSAGE in str(w.message) for w in caught[seen:])
                done += 1
        except Exception as exc:  # the sync's RuntimeError, or what it broke downstream
            error = f"{phase}: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            _set_mode(setup.device, "default")
    synchronize(setup.device)
    per_iteration = {p: counts[p] / done if done else None for p in PHASES}
    return {"per_iteration": per_iteration, "iterations": done, "error": error}


def records_of(setup: Setup) -> dict[str, int] | None:
    """Steps recorded and records dropped by an ampscope controller (None otherwise);
    resolves its pending steps on this thread, outside any debug mode."""
    telemetry = getattr(setup.controller, "telemetry", None)
    if telemetry is None:
        return None
    snapshot = telemetry.snapshot()
    return {"steps": snapshot.steps, "dropped": snapshot.dropped}


def control_raises(device: torch.device) -> bool | None:
    """Whether ``.item()`` of a device tensor raises under ``"error"`` (proof the mode is
    on); None on the CPU."""
    if device.type != "cuda":
        return None
    probe = torch.ones(1, device=device)
    _set_mode(device, "error")
    try:
        probe.item()
    except RuntimeError:
        return True
    finally:
        _set_mode(device, "default")
    return False


def census_pair(
    baseline: Setup,
    ours: Setup,
    inputs: tuple[torch.Tensor, ...],
    *,
    warmup: int,
    iterations: int,
    allowed: Sequence[str],
) -> dict[str, Any]:
    """Census and strict pass for a stock setup and its ampscope counterpart.

    ``added_per_iteration`` is ampscope's census minus stock's, per phase: the syncs
    ampscope adds. ``records`` shows that every iteration was recorded.
    """
    out: dict[str, Any] = {"allowed": list(allowed)}
    for role, setup in (("baseline", baseline), ("ampscope", ours)):
        for _ in range(warmup):
            iteration(setup, inputs)
        out[role] = {
            "name": setup.name,
            "census": run_pass(setup, inputs, iterations, allowed=None),
            "strict": run_pass(setup, inputs, iterations, allowed=allowed),
        }
        out[role]["records"] = records_of(setup)
        out[role]["iterations_total"] = warmup + sum(
            out[role][p]["iterations"] for p in ("census", "strict")
        )
    base = out["baseline"]["census"]["per_iteration"]
    mine = out["ampscope"]["census"]["per_iteration"]
    out["added_per_iteration"] = {
        p: None if base[p] is None or mine[p] is None else mine[p] - base[p] for p in PHASES
    }
    return out
