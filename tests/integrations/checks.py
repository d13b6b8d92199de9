"""Checks every integration test shares: same training, origin, records at the exporter."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

from support import DEADLOCK_GUARD_S, wait_until
from workers import INJECT_STEPS, STEPS, Net, inject_rank


def _ranks_once(
    url: str, run: str, world_size: int, holds: Callable[[Any], bool], what: str, timeout: float
) -> list[Any]:
    """``run``'s ranks at the exporter, by rank, once there are ``world_size`` of them and
    ``holds`` holds for each (``what`` names the wait when it fails: a hang guard)."""
    seen: list[Any] = []

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/api/v1/runs/{run}/ranks", timeout=5) as r:
                seen[:] = json.loads(r.read())
        except OSError:
            seen[:] = []
        return len(seen) == world_size and all(holds(rank) for rank in seen)

    wait_until(ready, what, timeout)
    return sorted(seen, key=lambda rank: rank["rank"])


def exporter_ranks(
    url: str, run: str, world_size: int, timeout: float = DEADLOCK_GUARD_S, steps: int = STEPS
) -> list[Any]:
    """The exporter's view of ``run``'s ranks once all have reported ``steps`` steps."""
    return _ranks_once(
        url,
        run,
        world_size,
        lambda rank: rank["step"] == steps,
        f"exporter did not get every step of {run}",
        timeout,
    )


def ranks_read(
    url: str, run: str, state: str, world_size: int = 1, timeout: float = DEADLOCK_GUARD_S
) -> list[Any]:
    """The exporter's view of ``run``'s ranks, by rank, once every one reads ``state``."""
    return _ranks_once(
        url,
        run,
        world_size,
        lambda rank: rank["state"] == state,
        f"{run}'s ranks never all read {state}",
        timeout,
    )


def check_failed_with(view: Any, exception: str, message: str) -> None:
    """``view`` (a failed rank's) carries the exception its training call raised, told as
    a ``with`` block over the front-end tells it."""
    failure = view["failure"]
    assert failure is not None, view
    assert (failure["kind"], failure["exception"], failure["message"]) == (
        "exception",
        exception,
        message,
    )
    assert failure["seen_by"] == "with"


def expected_skips() -> list[bool]:
    return [step in INJECT_STEPS for step in range(STEPS)]


def check_same_training(stock: dict[str, Any], ours: dict[str, Any]) -> None:
    """ampscope's scaler, and bit-identical parameters and scale trajectory."""
    assert stock["scaler_class"] == "torch.amp.grad_scaler.GradScaler"
    assert ours["scaler_class"] == "ampscope.rank.frontends.scalers.GradScaler"
    assert ours["scales"] == stock["scales"]
    assert ours["record_scales"] == stock["scales"]
    initial = [p.detach().flatten().tolist() for p in Net().parameters()]
    assert initial != stock["params"]  # it trained
    assert ours["params"] == stock["params"]  # bit for bit: float32 values as Python floats
    assert ours["skipped"] == expected_skips()


def check_origin(results: list[dict[str, Any]]) -> None:
    """Origin tracking names the injecting rank, at the injected steps, and no other."""
    world_size = len(results)
    for rank, ours in enumerate(results):
        wanted = expected_skips() if rank == inject_rank(world_size) else [False] * STEPS
        assert ours["origin"] == wanted, rank


def check_exporter(url: str, run: str, results: list[dict[str, Any]]) -> None:
    ranks = exporter_ranks(url, run, len(results))
    for view, ours in zip(ranks, results, strict=True):
        assert view["scale"] == ours["record_scales"][-1]
        assert view["totals"]["skipped_steps"] == len(INJECT_STEPS)
        origin = sum(view["totals"]["found_inf_origin"].values())
        assert origin == sum(ours["origin"])
    # Training ended normally: every rank says finished, no failure.
    ended = ranks_read(url, run, "finished", len(results))
    assert [view["failure"] for view in ended] == [None] * len(results)


def check_watch(
    result: dict[str, Any], rank: int = 0, world_size: int = 1, param: str = "head.weight"
) -> None:
    """A library's bf16/fp32 run with the watch it installed: ``observe`` bit-identical to
    the stock run, ``skip`` skipping the injected iterations and holding the scheduler."""
    stock, observe, skip = result["stock"], result["observe"], result["skip"]
    assert stock["installed"] is None
    first = min(INJECT_STEPS)
    for run, policy in ((observe, "observe"), (skip, "skip")):
        assert run["installed"] == "GradWatch"
        # Several ranks: origin tracked (the default), over the DDP group of all of them.
        group = {"origin_group": {"first": 0, "size": world_size}} if world_size > 1 else {}
        assert run["setup"] == {
            "mode": "watch",
            "policy": policy,
            "grad_dtype": "float32",
            **group,
        }
        assert run["event"] == ["none"]
        assert run["nonfinite"][first] == [param]
    # observe: the same bits, NaN weights included, and every update applied.
    assert observe["bits"] == stock["bits"]
    # Accelerate's scheduler steps once per process per step when batches are not split.
    per_step = stock["scheduler_steps"] // STEPS
    assert stock["scheduler_steps"] == per_step * STEPS
    assert observe["scheduler_steps"] == stock["scheduler_steps"]
    assert observe["skipped"] == [False] * STEPS
    assert observe["found"] == [step >= first for step in range(STEPS)]
    assert observe["applied"] == STEPS - first
    # skip: the framework's own skipped-step notion held the scheduler.
    assert skip["skipped"] == expected_skips()
    assert skip["found"] == expected_skips()
    assert skip["applied"] == 0
    assert skip["scheduler_steps"] == (STEPS - len(INJECT_STEPS)) * per_step
    assert skip["finite"]
    if world_size > 1:
        wanted = expected_skips() if rank == inject_rank(world_size) else [False] * STEPS
        assert skip["origin"] == wanted, rank
