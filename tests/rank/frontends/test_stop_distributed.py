"""The words every rank stops with, on two real gloo ranks, with and without NumPy.

Rank 1's own gradients overflow; a ``GradWatch(policy="raise")`` stops both ranks. The
ranks run as scripts (``tests/rank/stop_ranks.py``), so that one without NumPy can refuse
NumPy before torch is imported (see that script for why that stands for a venv without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S, free_port

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parents[1] / "stop_ranks.py"
AGREED = (
    "ampscope: non-finite gradients at step 2: policy 'raise' stops at the first non-finite "
    "iteration. Origin rank(s): 1."
)


def _ranks(*flags: str) -> list[dict[str, Any]]:
    """Run both ranks with ``flags``; each one's JSON line, by rank."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *flags],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for proc in procs:
            # Deadlock guard: a rank left alone in the gather would wait here.
            stdout, stderr = proc.communicate(timeout=4 * DEADLOCK_GUARD_S)
            assert proc.returncode == 0, stderr
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def test_every_rank_raises_the_same_words_with_and_without_numpy() -> None:
    with_numpy = _ranks()
    without = _ranks("--no-numpy")
    assert [r["numpy"] for r in with_numpy] == [True, True]
    assert [r["numpy"] for r in without] == [False, False]  # the ranks really lack it
    messages = {r["message"] for r in with_numpy + without}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(AGREED)
    assert "No rank's own gradients" not in message
    for rank in with_numpy + without:
        assert (rank["step"], rank["origin_ranks"], rank["gathered"]) == (2, [1], True)


def test_a_rank_that_cannot_gather_says_it_holds_its_own_view_only() -> None:
    ranks = _ranks("--no-numpy", "--no-gather")
    for rank in ranks:
        assert rank["gathered"] is False
        assert f"This is rank {rank['rank']}'s view only" in rank["message"]
        assert "No rank's own gradients" not in rank["message"]
    # Each says what it knows of itself, and nothing of the other rank.
    assert "Rank 0's own gradients held no inf/NaN before the reduction." in ranks[0]["message"]
    assert ranks[0]["origin_ranks"] == []
    assert "Origin rank(s): 1." in ranks[1]["message"]
    assert ranks[1]["origin_ranks"] == [1]
