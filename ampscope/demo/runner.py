"""Launch the demo's ranks as spawned processes and print their progress as it arrives."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

from ampscope.demo import trainer
from ampscope.demo.exporter import DemoError
from ampscope.demo.report import progress_lines


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


ABANDON_GRACE_S = 1.0
"""Seconds abandoned ranks (a failure, a stop signal) get after SIGTERM before SIGKILL."""
FINISH_GRACE_S = 10.0
"""Seconds finished ranks get to exit on their own (closing their reporters)."""


def _stop(processes: list[Any], finished: bool) -> None:
    """Join the ranks; abandoned ones are sent SIGTERM at once, and any left after the
    grace period (one deadline for all of them) SIGKILL."""
    if not finished:
        for process in processes:
            if process.is_alive():
                process.terminate()
    deadline = time.monotonic() + (FINISH_GRACE_S if finished else ABANDON_GRACE_S)
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def run_ranks(
    plan: trainer.Plan,
    world_size: int,
    emit: Callable[[str], None],
    timeout: float = 600.0,
) -> None:
    """Train ``plan`` on ``world_size`` CPU ranks (spawn, gloo on loopback).

    Prints one block of progress lines per ``plan.progress_every`` steps through ``emit``
    once every rank has reported that step. Returns when every rank finished.

    Raises:
        DemoError: a rank failed (its traceback is in the message), died, or the ranks did
            not finish within ``timeout`` seconds. The other ranks are killed.
    """
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=trainer.worker,
            args=(rank, world_size, port, plan, messages),
            name=f"ampscope-demo-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    waiting: dict[int, list[trainer.Progress]] = {}
    finished: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(finished) < world_size:
            if time.monotonic() > deadline:
                raise DemoError(f"the ranks did not finish within {timeout:.0f}s")
            try:
                kind, payload = messages.get(timeout=1.0)
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank not in finished and process.exitcode not in (None, 0):
                        raise DemoError(
                            f"rank {rank} died with exit code {process.exitcode}"
                        ) from None
                continue
            if kind == "progress":
                reports = waiting.setdefault(payload.step, [])
                reports.append(payload)
                if len(reports) == world_size:
                    del waiting[payload.step]
                    for line in progress_lines(payload.step, plan.steps, plan.scenarios, reports):
                        emit(line)
            elif kind == "done":
                finished.add(payload)
            else:
                rank, formatted = payload
                raise DemoError(f"rank {rank} failed:\n{formatted}")
    finally:
        _stop(processes, finished=len(finished) == world_size)
