"""The rerun of a flagged iteration on a CUDA GPU (the CPU tests are test_rerun.py): a
one-time fault is transient and the step goes on with the rerun's gradients, bit for bit
a clean run's; clean iterations never call the closure and read the agreed flag once on
the host (the one read the rerun is allowed). Skips without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch
from helpers import ListSink, Net, batch, poison

import ampscope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _CudaLoop:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net().cuda()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sink = ListSink()
        self.scaler = ampscope.GradScaler("cuda", init_scale=4.0, reporter=None, sinks=[self.sink])
        self.calls = 0
        self.corrupt_once = False

    def _backward(self, step: int) -> torch.Tensor:
        self.opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch(step).cuda())
        self.scaler.scale(loss).backward()
        if self.corrupt_once:
            self.corrupt_once = False
            poison(self.model.head.weight)
        return loss

    def step(self, step: int) -> None:
        self._backward(step)

        def closure() -> torch.Tensor:
            self.calls += 1
            return self._backward(step)

        self.scaler.step(self.opt, rerun=closure)
        self.scaler.update()


def test_one_time_fault_on_the_gpu_is_transient() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        loop, clean = _CudaLoop(), _CudaLoop()
        for step in range(6):
            loop.corrupt_once = step == 3
            loop.step(step)
            clean.step(step)
    finally:
        torch.use_deterministic_algorithms(False)
    assert loop.calls == 1
    assert clean.calls == 0
    outcome = loop.scaler.last_rerun
    assert outcome is not None
    assert outcome.flagged
    assert not outcome.reproduced
    for mine, theirs in zip(loop.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    loop.scaler.close()
    assert [r.rerun is not None for r in loop.sink.records] == [i == 3 for i in range(6)]
    assert not loop.sink.records[3].skipped
