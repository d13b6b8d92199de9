"""The training step every scaler benchmark times, and the scalers under comparison.

One MLP of residual blocks (LayerNorm, Linear, GELU, Linear): big enough that a CPU step
takes tens of milliseconds, with enough parameter tensors (6 per block) that per-tensor
scaler work shows. The same step runs with torch's stock scaler and with ampscope's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(*, width: int, depth: int, seed: int = 0) -> nn.Module:
    """The benchmark MLP, deterministically initialised (every copy is identical)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, width))


@dataclass(kw_only=True)
class Variant:
    """One contender: a model copy, its optimizer and its scaler."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    """``torch.amp.GradScaler`` or an ampscope scaler (same call protocol)."""

    def close(self) -> None:
        close: Callable[[], None] | None = getattr(self.scaler, "close", None)
        if close is not None:
            close()


def make_variant(
    name: str,
    model: nn.Module,
    scaler: Any,
    *,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> Variant:
    """A private copy of ``model`` (optionally wrapped, e.g. in DDP) with AdamW and ``scaler``."""
    own = copy.deepcopy(model)
    if wrap is not None:
        own = wrap(own)
    return Variant(
        name=name,
        model=own,
        optimizer=torch.optim.AdamW(own.parameters(), lr=1e-4),
        scaler=scaler,
    )


def train_step(
    variant: Variant, inputs: torch.Tensor, targets: torch.Tensor, *, autocast_dtype: Any
) -> float:
    """One full iteration (forward, scaled backward, step, update); returns its seconds.

    On CUDA the step ends with a synchronize so the host clock covers the device work;
    the same for every variant.
    """
    device_type = inputs.device.type
    start = time.perf_counter()
    variant.optimizer.zero_grad(set_to_none=True)
    with torch.autocast(
        device_type=device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None
    ):
        loss = nn.functional.mse_loss(variant.model(inputs), targets)
    variant.scaler.scale(loss).backward()
    variant.scaler.step(variant.optimizer)
    variant.scaler.update()
    if device_type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def stock_scaler(device: str) -> Any:
    """torch's own scaler, what users run without ampscope."""
    return torch.amp.GradScaler(device)


def ampscope_scaler(
    device: str, *, url: str | None, run_id: str, attribution: bool = True, stats: bool = True
) -> Any:
    """ampscope's drop-in scaler; reporting to the exporter at ``url`` (None: no reporter);
    ``stats=False``: without the loss and gradient norms."""
    from ampscope import GradScaler
    from ampscope.reporter.http import HttpReporter

    reporter = HttpReporter(url) if url is not None else None
    return GradScaler(
        device, reporter=reporter, run_id=run_id, attribution=attribution, stats=stats
    )
