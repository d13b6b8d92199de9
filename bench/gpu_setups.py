"""The training setups the GPU benchmark compares, and one iteration of each, by phase.

A setup is one copy of the model (plain, DDP or FSDP1 on a one-rank group), AdamW (fused
or not) and what drives the step: torch's stock scaler, ampscope's, ampscope's with origin
tracking, a ``GradWatch`` under ``observe``, or nothing (a plain bf16 loop). Every setup
of a comparison starts from the same weights and trains on the same batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

CONTROLLERS = (
    "stock",
    "ampscope",
    "ampscope_origin",
    "ampscope_reporter",
    "plain",
    "watch",
    "stock_clip",
    "ampscope_clip",
)
"""``*_clip``: the loop clips after ``unscale_`` (stock with ``torch.nn.utils.clip_grad_norm_``,
ampscope with its own ``clip_grad_norm_``, whose pass gives the records' norms)."""
CLIP_MAX_NORM = 1.0
WRAPS = ("none", "ddp", "fsdp1")
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}
PHASES = ("zero_grad", "forward", "backward", "step", "update")


@dataclass(kw_only=True)
class Setup:
    """One contender: model, optimizer and the object that drives its step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    controller: Any
    """A scaler, a ``GradWatch`` or ``None`` (plain loop: ``optimizer.step()``)."""
    autocast_dtype: torch.dtype
    device: torch.device
    extra: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        close: Callable[[], None] | None = getattr(self.controller, "close", None)
        if close is not None:
            close()


def _controller(kind: str, device: torch.device, wrap: str, url: str | None) -> Any:
    import ampscope

    dev = device.type
    if kind == "plain":
        return None
    if kind == "watch":
        return ampscope.GradWatch("observe", reporter=None, run_id="bench-gpu-watch")
    if kind in ("stock", "stock_clip"):
        if wrap == "fsdp1":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(dev)
        return torch.amp.GradScaler(dev)
    reporter: Any = None
    if kind == "ampscope_reporter":
        from ampscope.reporter.http import HttpReporter

        if url is None:
            raise ValueError("ampscope_reporter needs the exporter's url")
        reporter = HttpReporter(url)
    scaler_class = ampscope.ShardedGradScaler if wrap == "fsdp1" else ampscope.GradScaler
    return scaler_class(dev, reporter=reporter, run_id=f"bench-gpu-{kind}")


def make_setup(
    name: str,
    base: nn.Module,
    *,
    device: torch.device,
    controller: str,
    precision: str,
    fused: bool,
    wrap: str = "none",
    url: str | None = None,
) -> Setup:
    """A private copy of ``base`` on ``device``, wrapped, with AdamW and its controller.

    ``ddp`` and ``fsdp1`` need an initialised default process group (one rank is enough);
    ``ampscope_origin`` needs one of them.

    Args:
        controller: One of :data:`CONTROLLERS`.
        precision: Autocast dtype, ``fp16`` or ``bf16``.
        wrap: One of :data:`WRAPS`.
    """
    if controller not in CONTROLLERS or wrap not in WRAPS or precision not in PRECISIONS:
        raise ValueError(f"unknown setup: {controller=}, {wrap=}, {precision=}")
    model: nn.Module = copy.deepcopy(base).to(device)
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index or 0] if device.type == "cuda" else None
        )
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    driver = _controller(controller, device, wrap, url)
    if controller == "ampscope_origin":
        driver.attach(model, track_origin=True)
    elif controller in ("ampscope", "ampscope_reporter", "watch", "ampscope_clip"):
        driver.attach(model)
    return Setup(
        name=name,
        model=model,
        optimizer=optimizer,
        controller=driver,
        autocast_dtype=PRECISIONS[precision],
        device=device,
        extra={"clip": controller.endswith("_clip")},
    )


def clip(setup: Setup) -> None:
    """A clipping setup's unscale and clip, between backward and step."""
    driver = setup.controller
    driver.unscale_(setup.optimizer)
    clip_grad_norm_ = getattr(driver, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
    clip_grad_norm_(setup.model.parameters(), CLIP_MAX_NORM)


def phases(
    setup: Setup, inputs: tuple[torch.Tensor, ...]
) -> Iterator[tuple[str, Callable[[], None]]]:
    """One iteration as ``(phase, call)`` pairs in order (see :data:`PHASES`); the caller
    runs each call before asking for the next."""
    state: dict[str, torch.Tensor] = {}
    driver = setup.controller

    def zero_grad() -> None:
        setup.optimizer.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.autocast(device_type=setup.device.type, dtype=setup.autocast_dtype):
            state["loss"] = setup.model(*inputs)

    def backward() -> None:
        loss = state.pop("loss")
        (loss if driver is None else driver.scale(loss)).backward()

    def step() -> None:
        if driver is None:
            setup.optimizer.step()
        else:
            if setup.extra.get("clip"):
                clip(setup)
            driver.step(setup.optimizer)

    def update() -> None:
        if driver is not None:
            driver.update()

    yield "zero_grad", zero_grad
    yield "forward", forward
    yield "backward", backward
    yield "step", step
    yield "update", update


def iteration(setup: Setup, inputs: tuple[torch.Tensor, ...]) -> None:
    """One training iteration, no timing and no synchronisation."""
    setup.optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=setup.device.type, dtype=setup.autocast_dtype):
        loss = setup.model(*inputs)
    driver = setup.controller
    if driver is None:
        loss.backward()
        setup.optimizer.step()
        return
    driver.scale(loss).backward()
    if setup.extra.get("clip"):
        clip(setup)
    driver.step(setup.optimizer)
    driver.update()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ProcessGroup:
    """A one-rank default process group for DDP and FSDP1 (NCCL on CUDA, gloo on the CPU),
    created if none exists and destroyed by :meth:`close` only if created here."""

    device: torch.device
    created: bool = False

    def __enter__(self) -> ProcessGroup:
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self.created = True
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if self.created and dist.is_initialized():
            dist.destroy_process_group()
