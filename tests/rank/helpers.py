"""Small shared pieces of the single-process scaler tests."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ampscope.rank.capture.scaler import StepCapture
from ampscope.reporter.schema import StepRecord


class ListSink:
    """Keeps every record it gets, and the thread that delivered it."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.threads: set[str] = set()
        self.closed_with: float | None = None

    def emit(self, record: StepRecord) -> None:
        self.records.append(record)
        self.threads.add(threading.current_thread().name)

    def close(self, timeout: float) -> None:
        self.closed_with = timeout


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(10, 6, sparse=sparse, dtype=dtype)
        self.body = nn.Linear(6, 6, dtype=dtype)
        self.head = nn.Linear(6, 2, dtype=dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(idx)))).float().square().mean()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(step))


def poison(param: torch.Tensor, value: float = float("inf")) -> None:
    """Put one non-finite value into ``param``'s gradient (dense or sparse)."""
    grad = param.grad
    assert grad is not None
    if grad.is_sparse:
        grad._values().view(-1)[0] = value
    else:
        grad.view(-1)[0] = value


def run(
    scaler: torch.amp.GradScaler,
    model: Net,
    optimizers: list[torch.optim.Optimizer],
    steps: int,
    *,
    inject: Callable[[Net, int], None] = lambda model, step: None,
    clip: bool = False,
) -> list[float]:
    """Train; returns the scale after each update()."""
    scales = []
    for step in range(steps):
        scaler.scale(model(batch(step))).backward()
        inject(model, step)
        if clip:
            for opt in optimizers:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def use_device_transport(scaler: torch.amp.GradScaler) -> None:
    """Make an instrumented CPU scaler capture as it does on accelerators: stacked copies
    read later by the telemetry thread, instead of reading host memory at update()."""
    scaler._ampscope_capture = StepCapture(read_on_host=False)  # type: ignore[attr-defined]


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts, under ``["n"]``, every read of a tensor's value on the calling thread
    (``item``, ``tolist``, ``bool``, ``float``, ``int``): on an accelerator each one is a
    host-device sync. Other threads (the telemetry thread) are not counted."""
    main = threading.current_thread()
    reads = {"n": 0}
    for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)

        def counted(self: torch.Tensor, *a: object, _original: object = original) -> object:
            if threading.current_thread() is main:
                reads["n"] += 1
            return _original(self, *a)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, method, counted)
    return reads


def repeated_shapes() -> torch.nn.Sequential:
    """Small layers of one shape (stacked for the CPU's norms), one layer of another shape,
    and one too large to stack (normed on its own)."""
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 300),
        torch.nn.Linear(300, 300),
        torch.nn.Linear(300, 1),
    )
