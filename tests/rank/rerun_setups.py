"""One training loop with a rerun closure, shared by the single-process rerun tests
(tests/rank/frontends/test_rerun.py, test_watch_rerun.py, test_rerun_cuda.py)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import Net, batch, poison

NAN = float("nan")


class RerunLoop:
    """``Net`` trained by SGD through ``front_end`` (a scaler or a watch), each step with a
    rerun closure over the same batch, on ``device``, under autocast to ``dtype`` if given.

    ``corrupt_once`` poisons the head's gradient after the next backward only (a one-time
    fault of this rank's device); ``bad_input`` makes the loss NaN on every pass (bad data);
    ``spike`` is added to the loss on every pass (a spike of the loss alone: the gradients
    and so the weights stay those of a clean run), ``spike_once`` on the next pass only.
    ``calls`` counts the closure's calls.
    """

    def __init__(
        self, front_end: Any, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        self.model = Net().to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.front_end = front_end
        self.device = device
        self.dtype = dtype
        self.calls = 0
        self.corrupt_once = False
        self.bad_input = False
        self.spike = 0.0
        self.spike_once = 0.0

    def _backward(self, step: int) -> torch.Tensor:
        self.opt.zero_grad()
        device_type = torch.device(self.device).type
        with torch.autocast(device_type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.model(batch(step).to(self.device)).float()
        loss = loss + (self.spike + self.spike_once)
        self.spike_once = 0.0
        if self.bad_input:
            loss = loss * NAN
        self.front_end.scale(loss).backward()
        if self.corrupt_once:
            self.corrupt_once = False
            poison(self.model.head.weight)
        return loss

    def step(self, step: int) -> None:
        self.front_end.note_batch([10 * step, 10 * step + 1])
        self._backward(step)

        def closure() -> torch.Tensor:
            self.calls += 1
            return self._backward(step)

        self.front_end.step(self.opt, rerun=closure)
        self.front_end.update()
