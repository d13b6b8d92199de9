"""Found-inf flags: grouping as torch's unscale groups, the fused check, the max per device."""

from __future__ import annotations

import math

import torch
from torch import nn

from ampscope.rank.capture.registry import OptimizerInfo
from ampscope.rank.gradients.nonfinite import (
    check_local,
    group_by_place,
    max_of,
    max_per_device,
)

CPU = torch.device("cpu")


def test_grouping_is_by_device_then_dtype_in_first_seen_order() -> None:
    a = torch.zeros(1, dtype=torch.bfloat16)
    b = torch.zeros(2)
    c = torch.zeros(3, dtype=torch.bfloat16)
    groups = group_by_place([a, b, c])
    assert list(groups) == [CPU]
    assert list(groups[CPU]) == [torch.bfloat16, torch.float32]
    assert [id(t) for t in groups[CPU][torch.bfloat16]] == [id(a), id(c)]
    assert [id(t) for t in groups[CPU][torch.float32]] == [id(b)]
    assert group_by_place([]) == {}


def test_the_max_of_flags() -> None:
    zero, one = torch.zeros(1), torch.ones(1)
    assert max_of([zero]) is zero
    assert max_of([zero, one, zero]).tolist() == [1.0]
    assert (zero.item(), one.item()) == (0.0, 1.0)  # nothing written


def test_the_max_per_device() -> None:
    other = torch.device("meta")
    only = {CPU: torch.zeros(1)}
    assert max_per_device([only]) is only
    merged = max_per_device(
        [{CPU: torch.zeros(1)}, {other: torch.empty(1, device=other), CPU: torch.ones(1)}]
    )
    assert list(merged) == [CPU, other]
    assert merged[CPU].tolist() == [1.0]
    assert max_per_device([]) == {}


def _optimizer(*params: nn.Parameter) -> tuple[torch.optim.Optimizer, OptimizerInfo]:
    optimizer = torch.optim.SGD(list(params), lr=0.1)
    info = OptimizerInfo(optimizer, 0, count_steps=False)
    info.refresh(optimizer)
    return optimizer, info


def test_check_local_finds_inf_nan_in_any_group_and_changes_nothing() -> None:
    dense = nn.Parameter(torch.zeros(3))
    narrow = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    unused = nn.Parameter(torch.zeros(1))
    optimizer, info = _optimizer(dense, narrow, unused)
    assert info.place is None  # two dtypes: grouped
    dense.grad = torch.tensor([1.0, 2.0, 3.0])
    narrow.grad = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    ones: dict[torch.device, torch.Tensor] = {}
    assert {d: f.tolist() for d, f in check_local(optimizer, info, ones).items()} == {CPU: [0.0]}
    narrow.grad[1] = math.nan
    assert check_local(optimizer, info, ones)[CPU].tolist() == [1.0]
    assert dense.grad.tolist() == [1.0, 2.0, 3.0]  # unscaled by 1: unchanged
    assert list(ones) == [CPU]


def test_check_local_reads_a_sparse_gradients_values() -> None:
    table = nn.Parameter(torch.zeros(4, 2))
    optimizer, info = _optimizer(table)
    assert info.place is not None
    table.grad = torch.sparse_coo_tensor([[1]], [[1.0, math.inf]], (4, 2), check_invariants=True)
    assert check_local(optimizer, info, {})[CPU].tolist() == [1.0]
    table.grad = None
    assert check_local(optimizer, info, {})[CPU].tolist() == [0.0]  # no gradient: clean
