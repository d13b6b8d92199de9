"""How every replica judges the gathered fingerprints: the minority where a strict majority
agrees, everyone in the disagreement where none does."""

from __future__ import annotations

import torch

from ampscope.rank.replicas.check import _judge


def test_agreeing_replicas_have_no_differing_column() -> None:
    rows = torch.tensor([[1, 2, 3]] * 4)
    assert _judge(rows) == {}


def test_a_strict_majority_names_the_odd_ones_out() -> None:
    rows = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 7]])
    found = _judge(rows)
    assert sorted(found) == [1, 2]
    assert (found[1].positions, found[1].majority) == ((2,), True)
    assert (found[2].positions, found[2].majority) == ((3,), True)


def test_two_replicas_or_a_tie_leave_no_majority() -> None:
    pair = _judge(torch.tensor([[5, 1], [5, 2]]))
    assert (pair[1].positions, pair[1].majority) == ((0, 1), False)
    tie = _judge(torch.tensor([[1], [1], [2], [2]]))
    assert (tie[0].positions, tie[0].majority) == ((0, 1, 2, 3), False)


def _failing_rank(rank: int, world_size: int) -> dict[str, object]:
    import torch
    from torch import nn

    from ampscope.rank.replicas.check import ReplicaCheck

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    check = ReplicaCheck(ddp, every=1)
    if rank == 1:
        (set_check,) = check._sets

        def out_of_memory() -> torch.Tensor:
            raise RuntimeError("out of memory (test)")

        set_check.plan.chunks = out_of_memory  # type: ignore[method-assign]
    seen: list[object] = []
    for _ in range(2):
        try:
            outcome = check.after_step()
            seen.append(None if outcome is None else outcome.agree)
        except RuntimeError as error:
            seen.append(str(error))
    return {"seen": seen}


def test_a_replica_that_cannot_fingerprint_still_takes_part_in_the_gather() -> None:
    """A failure before the all-gather on one rank (out of memory for the packed copy): the
    others get no outcome that time, never a wait for a rank that left the collective."""
    from support import DEADLOCK_GUARD_S, run_distributed

    results = run_distributed(_failing_rank, 3, timeout=2 * DEADLOCK_GUARD_S)
    assert [r["seen"] for r in results] == [
        [None, None],
        ["out of memory (test)"] * 2,
        [None, None],
    ]
