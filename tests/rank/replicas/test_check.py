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
