"""The found-inf check where torch's fused kernel lacks the dtype (bfloat16 on CUDA).

On the CPU the fallback is forced by marking the group as refused; the CUDA test runs the
real case, a bf16 ``GradWatch`` whose gradients torch's CUDA kernel cannot check, and skips
without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ampscope
from ampscope.rank import compat


@pytest.fixture
def refused() -> Iterator[None]:
    key = ("cpu", torch.bfloat16)
    compat._KERNEL_LACKS.add(key)
    try:
        yield
    finally:
        compat._KERNEL_LACKS.discard(key)


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_the_fallback_flags_inf_and_nan_and_writes_nothing(refused: None, bad: float) -> None:
    grads = [torch.randn(5, dtype=torch.bfloat16), torch.randn(3, 2, dtype=torch.bfloat16)]
    if bad is not None:
        grads[1][2, 1] = bad
    before = [g.clone() for g in grads]
    found = torch.zeros(1)
    compat.non_finite_check_(grads, found, torch.ones(1))
    assert found.item() == (0.0 if bad is None else 1.0)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.view(torch.int16), b.view(torch.int16))  # read only
    compat.non_finite_check_(grads[:1], found, torch.ones(1))
    assert found.item() == (0.0 if bad is None else 1.0)  # a flag once set stays set


def test_large_finite_values_are_not_flagged(refused: None) -> None:
    grads = [torch.full((4,), 3.0e38, dtype=torch.bfloat16)]  # sums past float32's max
    found = torch.zeros(1)
    compat.non_finite_check_(grads, found, torch.ones(1))
    assert found.item() == 0.0


def _watch_run(device: str) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = ampscope.GradWatch("skip", reporter=None)
    skipped = []
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(2, 8, device=device, dtype=torch.bfloat16)
        watch.scale(model(x).square().mean()).backward()
        if step == 2:
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = float("nan")
        watch.step(opt)
        watch.update()
        skipped.append(watch.last_step_skipped)
    watch.close()
    assert watch._ampscope_errors == 0  # the check ran, it did not fail and count as clean
    return skipped


def test_a_bf16_watch_with_the_fallback_skips_the_nan_step(refused: None) -> None:
    assert _watch_run("cpu") == [False, False, True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bf16_watch_on_cuda_skips_the_nan_step() -> None:
    assert _watch_run("cuda") == [False, False, True, False]
