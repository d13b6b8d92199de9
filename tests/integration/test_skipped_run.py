"""A bf16 run under ``GradWatch(policy="skip")`` whose steps were skipped for inf/NaN is named.

Two real ranks (gloo, CPU, DDP) train under a watch with origin tracking, each reporting
through the real ``HttpReporter`` to a real exporter process. Rank 1's batch holds an inf at
three steps: DDP spreads it, both ranks skip those steps, and origin tracking pins it on
rank 1. The exporter's health must warn with ``nonfinite_skipped``, naming how many steps were
skipped, the last one and rank 1 as its origin, and ``ampscope status`` must show it; a
second run of the same ranks without a bad batch must stay quiet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed

pytestmark = pytest.mark.distributed

STEPS = 20
BAD_STEPS = (5, 9, 14)
BAD_RANK = 1


def _rank(rank: int, world_size: int, url: str, run: str, bad: tuple[int, ...]) -> list[bool]:
    """One DDP rank under a skipping watch; returns whether each step was skipped."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ampscope
    from ampscope.reporter.http import HttpReporter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = ampscope.GradWatch("skip", reporter=HttpReporter(url, flush_interval=0.05), run_id=run)
    watch.attach(model, track_origin=True)
    skipped = []
    for step in range(1, STEPS + 1):
        x = torch.ones(4, 8)
        if rank == BAD_RANK and step in bad:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()
        optimizer.zero_grad()
        skipped.append(watch.last_step_skipped)
    watch.close(timeout=DEADLOCK_GUARD_S)  # returns once every record and the final one arrived
    return skipped


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


@pytest.mark.parametrize(("run", "bad"), [("skips", BAD_STEPS), ("clean", ())])
def test_steps_skipped_for_inf_are_named_with_their_origin(
    exporter: str, run: str, bad: tuple[int, ...]
) -> None:
    results = run_distributed(_rank, 2, args=(exporter, run, bad), env={"AMPSCOPE_NODE": "n0"})
    # The loops saw the skips the verdict must name: both ranks, at the bad steps only.
    for skipped in results:
        assert [step for step, hit in enumerate(skipped, 1) if hit] == list(bad)
    ranks = _get(f"{exporter}/api/v1/runs/{run}/ranks")
    assert [(r["step"], r["state"]) for r in ranks] == [(STEPS, "finished")] * 2
    health = _get(f"{exporter}/api/v1/runs/{run}/health")
    verdict = {v["rule"]: v for v in health["verdicts"]}["nonfinite_skipped"]
    status = subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "status", run, "--url", exporter],
        capture_output=True,
        text=True,
        timeout=DEADLOCK_GUARD_S,
        check=False,
    )
    (line,) = [line for line in status.stdout.splitlines() if "nonfinite_skipped" in line]
    if not bad:
        assert (verdict["status"], health["status"]) == ("ok", "ok")
        assert verdict["summary"] == "no step skipped for inf/NaN gradients within 600 s"
        assert (line.split()[0], status.returncode) == ("ok", 0)
        return
    assert verdict["status"] == health["status"] == "warning"
    evidence = verdict["evidence"]
    assert (evidence["skipped"], evidence["last_step"]) == (len(BAD_STEPS), BAD_STEPS[-1])
    assert (evidence["origin_tracked"], evidence["origin_ranks"]) == (True, [BAD_RANK])
    assert [(r["rank"], r["skipped"], r["origin"]) for r in evidence["ranks"]] == [
        (0, 3, False),
        (1, 3, True),
    ]
    summary = (
        "3 step(s) skipped for inf/NaN gradients within 600 s (watch policy skip), the last "
        f"at step {BAD_STEPS[-1]}; origin: rank(s) {BAD_RANK}"
    )
    assert verdict["summary"] == summary
    assert line.split()[0] == "WARN"
    assert line.endswith(summary)
    assert status.returncode == 1
