"""A watch closed on one rank keeps taking part in every collective the open ranks make.

One launch per world size (2 and 4 real gloo ranks) runs four scenarios in sequence: a
``GradWatch`` under ``skip`` and under ``raise``, each without and with a rerun closure;
the last rank closes its watch after ``CLOSE_AFTER`` iterations, and rank 0's data turns
NaN at ``BAD_STEP`` (on every pass: a rerun reproduces it). No collective mismatch and no
hang: under ``skip`` every rank skips that step and the weights stay alike on every rank;
under ``raise`` every rank raises at it, the closed one included.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, run_distributed

pytestmark = pytest.mark.distributed

STEPS = 6
CLOSE_AFTER = 2
BAD_STEP = 4


def _scenario(rank: int, world_size: int, policy: str, rerun: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    import ampscope

    torch.manual_seed(3)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = ampscope.GradWatch(policy, reporter=None)
    calls = 0
    skipped: list[int] = []
    raised = None
    data = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        if step == CLOSE_AFTER + 1 and rank == world_size - 1:
            watch.close()
        x = torch.randn(3, 4, generator=data)
        if rank == 0 and step == BAD_STEP:
            x[0, 0] = float("nan")

        def closure(x: Any = x) -> Any:
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = model(x).square().mean()
            watch.scale(loss).backward()
            return loss

        opt.zero_grad()
        watch.scale(model(x).square().mean()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            watch.step(opt, rerun=closure if rerun else None)
        except ampscope.NonFiniteGradientsError as error:
            raised = error.step
            break
        watch.update()
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)):
            skipped.append(step)
    watch.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"calls": calls, "skipped": skipped, "raised": raised, "checksum": checksum}


def _rank(rank: int, world_size: int) -> dict[tuple[str, bool], dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    return {
        (policy, rerun): _scenario(rank, world_size, policy, rerun)
        for policy in ("skip", "raise")
        for rerun in (False, True)
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_closed_watch_keeps_the_collectives_paired(world_size: int) -> None:
    results = run_distributed(_rank, world_size, timeout=6 * DEADLOCK_GUARD_S)
    for rerun in (False, True):
        skip = [out[("skip", rerun)] for out in results]
        assert [s["skipped"] for s in skip] == [[BAD_STEP]] * world_size, rerun
        assert len({s["checksum"] for s in skip}) == 1, rerun  # the weights stay alike
        assert [s["raised"] for s in skip] == [None] * world_size
        stopped = [out[("raise", rerun)] for out in results]
        assert [s["raised"] for s in stopped] == [BAD_STEP] * world_size, rerun
        # Every rank reran the flagged step once, the closed one included.
        expected = [1 if rerun else 0] * world_size
        assert [s["calls"] for s in skip] == expected
        assert [s["calls"] for s in stopped] == expected
