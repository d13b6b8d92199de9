"""The rerun's agreement across real ranks (2 gloo processes): a fault on a rank's rerun
pass only, and a rank whose front-end was closed while the others still rerun."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import Net, batch, poison
from support import run_distributed

import ampscope

FAULT_STEP = 2


def _worker(rank: int, world_size: int, scenario: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # "closed": observe, whose policy adds no agreement of its own (skip's and raise's
    # all-reduce of the found-inf flag is not the rerun's to keep paired).
    watch = ampscope.GradWatch("observe" if scenario == "closed" else "skip", reporter=None)
    calls = [0]
    outcome: dict[str, Any] = {}

    def backward(step: int, poisoned: bool) -> torch.Tensor:
        opt.zero_grad()
        loss = model(batch(10 * rank + step))
        watch.scale(loss).backward()
        if poisoned:
            poison(model.head.weight)
        return loss

    for step in range(4):
        at_fault = step == FAULT_STEP
        if scenario == "closed" and rank == 1 and at_fault:
            watch.close()  # training goes on; this rank must still take part
        backward(step, poisoned=at_fault and rank == 0)

        def closure(step: int = step, at_fault: bool = at_fault) -> torch.Tensor:
            calls[0] += 1
            # "rerun-fault": rank 1's rerun pass (only) holds an inf.
            return backward(step, poisoned=scenario == "rerun-fault" and rank == 1 and at_fault)

        watch.step(opt, rerun=closure)
        watch.update()
        if at_fault and watch.last_rerun is not None:
            last = watch.last_rerun
            outcome = {
                "flagged": last.flagged,
                "reproduced": last.reproduced,
                "first_nonfinite": last.first.nonfinite,
                "second_nonfinite": last.second.nonfinite,
            }
    watch.close()
    return {"calls": calls[0], "outcome": outcome}


@pytest.mark.distributed
def test_a_fault_of_the_rerun_pass_alone_is_that_ranks_transient_fault() -> None:
    rank0, rank1 = run_distributed(_worker, 2, args=("rerun-fault",))
    assert rank0["calls"] == rank1["calls"] == 1
    # Rank 0: inf on its first pass only.
    assert rank0["outcome"] == {
        "flagged": True,
        "reproduced": False,
        "first_nonfinite": True,
        "second_nonfinite": False,
    }
    # Rank 1: clean first, inf on the rerun: its device made it, and the verdict says so.
    assert rank1["outcome"] == {
        "flagged": True,
        "reproduced": False,
        "first_nonfinite": False,
        "second_nonfinite": True,
    }


@pytest.mark.distributed
def test_a_closed_front_end_still_takes_part_in_the_agreement() -> None:
    rank0, rank1 = run_distributed(_worker, 2, args=("closed",))
    # Rank 0 flagged step 2; rank 1, closed, agreed and called its closure too (no hang).
    assert rank0["calls"] == 1
    assert rank0["outcome"]["flagged"]
    assert rank1["calls"] == 1
    assert rank1["outcome"] == {}
