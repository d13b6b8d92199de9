"""``support.run_distributed``: a failing run names every rank's outcome, not the first only."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import run_distributed


def _rank1_raises(rank: int, world_size: int) -> str:
    if rank == 1:
        raise ValueError("rank 1's own fault")
    # Rank 0 waits for rank 1 in a collective, as a training step would: its peer is gone.
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def _rank1_ends(rank: int, world_size: int, how: str) -> Any:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "unpicklable":
            return lambda: None  # the results queue drops it: the rank exits 0, silent
    return "rank 0's result"


def _rank0_blocks(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1's own fault")
    time.sleep(3600)  # a rank that never reports, as one stuck in a collective


def _failure(fn: Any, **kwargs: Any) -> str:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_distributed(fn, 2, **kwargs)
    return str(failed.value)


@pytest.mark.distributed
def test_the_other_ranks_are_heard_after_one_fails() -> None:
    text = _failure(_rank1_raises)
    assert re.search(r"^rank 1 failed( \(the first to fail\))?:$", text, re.M), text
    assert "ValueError: rank 1's own fault" in text
    # Rank 0 lost its peer mid-collective: its own error, or its process's state.
    assert re.search(r"^rank 0 (failed|did not report)", text, re.M), text
    assert "unreachable" not in text


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("how", "status"),
    [
        ("exit", "exit code 3"),
        ("signal", "killed by signal SIGKILL"),
        ("unpicklable", "exit code 0"),
    ],
)
def test_a_rank_that_ends_without_reporting_is_named_with_its_exit_status(
    how: str, status: str
) -> None:
    text = _failure(_rank1_ends, args=(how,))
    assert text.splitlines()[0] == "rank 0: ok"
    assert re.search(rf"^rank 1 did not report \(the first to fail\): {status}$", text, re.M)


@pytest.mark.distributed
def test_a_rank_that_never_reports_is_named_still_running() -> None:
    # A short grace: it only checks that rank 0 does NOT report, which it never would.
    text = _failure(_rank0_blocks, grace=1.0)
    assert "ValueError: rank 1's own fault" in text
    assert re.search(
        r"^rank 0 did not report: still running 1s after the first failure, killed$", text, re.M
    ), text
