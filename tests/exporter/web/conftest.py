"""A live exporter process fed by two real DDP ranks with injected overflows, shared by the
browser tests of this directory (one training launch, ~10 s on 2 cores)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port, run_distributed

from ampscope.demo.exporter import ExporterProcess

RUN = "web-run"
STEPS = 30
OVERFLOW_STEPS = (4, 5, 9, 13, 14, 20)
"""Steps whose input holds an inf on rank 1 only: DDP spreads it (both ranks skip and see it
locally) while origin tracking pins it on rank 1, a hotspot."""
RESTORE_AFTER = 21
"""Rank 1 loads a stale scaler state after this step's update: the ranks' scales split."""


def _train(rank: int, world_size: int) -> list[tuple[int, float, bool]]:
    import torch

    import ampscope

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler.attach(model, track_origin=True)
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    stale = None
    for step in range(1, STEPS + 1):
        batch = data.clone()
        if rank == 1 and step in OVERFLOW_STEPS:
            batch[0, 0] = float("inf")
        scaler.scale(model(batch).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if rank == 1 and step == 1:
            stale = scaler.state_dict()
        if rank == 1 and step == RESTORE_AFTER:
            scaler.load_state_dict(stale)
    scaler.telemetry.snapshot()
    history = [(r.step, r.scale_after, r.skipped) for r in scaler.telemetry.history()]
    scaler.close()
    return history


@dataclass(frozen=True)
class LiveRun:
    url: str
    truth: list[list[tuple[int, float, bool]]]
    """Per rank: (step, scale_after, skipped) as the rank's own telemetry recorded them."""


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def live_run() -> Iterator[LiveRun]:
    exporter = ExporterProcess(free_port())
    exporter.start()
    try:
        truth = run_distributed(
            _train,
            env={"AMPSCOPE_URL": exporter.url, "AMPSCOPE_RUN_ID": RUN},
            timeout=120,
        )
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        while True:
            ranks = get_json(f"{exporter.url}/api/v1/runs/{RUN}/ranks")
            if [r["step"] for r in ranks] == [STEPS, STEPS]:
                break
            assert time.monotonic() < deadline, f"ranks did not deliver every step: {ranks}"
            time.sleep(0.1)
        yield LiveRun(url=exporter.url, truth=truth)
    finally:
        exporter.stop()
