"""The rerun of a flagged iteration on a CUDA GPU (the CPU tests are test_rerun.py): a
one-time fault is transient and the step goes on with the rerun's gradients, bit for bit
a clean run's; clean iterations never call the closure and read the agreed flag once on
the host (the one read the rerun is allowed). Skips without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch
from helpers import ListSink
from rerun_setups import RerunLoop

import ampscope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_loop() -> RerunLoop:
    sink = ListSink()
    scaler = ampscope.GradScaler("cuda", init_scale=4.0, reporter=None, sinks=[sink])
    loop = RerunLoop(scaler, device="cuda", dtype=torch.float16)
    loop.sink = sink  # type: ignore[attr-defined]
    return loop


def test_one_time_fault_on_the_gpu_is_transient() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        loop, clean = _cuda_loop(), _cuda_loop()
        for step in range(6):
            loop.corrupt_once = step == 3
            loop.step(step)
            clean.step(step)
    finally:
        torch.use_deterministic_algorithms(False)
    assert loop.calls == 1
    assert clean.calls == 0
    outcome = loop.front_end.last_rerun
    assert outcome is not None
    assert outcome.flagged
    assert not outcome.reproduced
    for mine, theirs in zip(loop.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    loop.front_end.close()
    assert [r.rerun is not None for r in loop.sink.records] == [i == 3 for i in range(6)]
    assert not loop.sink.records[3].skipped
