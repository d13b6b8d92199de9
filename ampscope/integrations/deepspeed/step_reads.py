"""One DeepSpeed optimizer step on its way to the telemetry thread, with no host read of a
device value on the training thread.

Right after DeepSpeed's boundary ``step()`` the training thread builds :class:`StepReads`:

* DeepSpeed's host state, read as it is (Python values DeepSpeed already holds):
  ``was_step_applied()``, the optimizer's ``overflow`` when it is a bool, the fp16 scale
  (``cur_scale``) and its dynamic scaler's iteration counters;
* every value that lives on a device, unread: the origin flag vectors (this rank's own
  gradients before the reduction), the reduced gradients' flag vectors (where the monitor
  checks them: DeepSpeed gives no verdict there), DeepSpeed's norm when it is a tensor, the
  ``torch_autocast`` GradScaler's scale before and after the step, the rank's loss. They
  are cast to float64 (exact for every one of them: flags, float32 and float64 norms,
  scales, the loss) and concatenated into one vector on the module's device, whose
  copy to pinned host memory starts without blocking, with an event
  (:func:`~ampscope.rank.capture.pending.to_host_async`): the scalers' and the watch's
  device transport. On the CPU the vector is itself the host copy (no event).

The telemetry thread waits for the copy and decodes it (:meth:`StepReads.read`): the
monitor takes its decisions from those host values there (``found``, ``applied``, the
policy, the growth tracker), in step order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ampscope.integrations.deepspeed import engine as ds
from ampscope.integrations.deepspeed.origin import (
    BoundaryGradientFlags,
    BucketGradientFlags,
    OwnGradientFlags,
)
from ampscope.rank.capture.pending import to_host_async

Flags = BoundaryGradientFlags | BucketGradientFlags | OwnGradientFlags

_SCALARS = ("norm", "before", "after", "loss")
"""The one-value parts a step may carry, in the order they follow the flag vectors."""


class HostStep(NamedTuple):
    """One boundary step's values on the host (telemetry thread)."""

    overflow: bool
    """DeepSpeed's overflow flag (host state)."""
    applied: bool
    """``was_step_applied()``."""
    before: float
    """The loss scale before the step (1.0 without one)."""
    after: float
    """The loss scale after the step."""
    norm: float | None
    """DeepSpeed's global gradient norm; ``None``: it computed none."""
    loss: float | None
    """The rank's loss sum over the step's micro-batches; ``None``: no stats."""
    origin: dict[str, bool]
    """Per device: this rank's own gradients held inf/NaN before the reduction."""
    named: dict[str, int]
    """The parameters whose own gradients held inf/NaN."""
    reduced: bool
    """The reduced gradients held inf/NaN (``False`` where the monitor does not check
    them: DeepSpeed's own verdict covers that step)."""
    counters: ds.ScalerCounters | None
    """The fp16 dynamic scaler's iteration counters after the step."""


class StepReads:
    """What the training thread takes of one boundary step, without a host read of a
    device value: see the module docstring. Built right after DeepSpeed's ``step()``.

    Args:
        engine: The DeepSpeed engine.
        before: The loss scale taken before ``step()`` (:func:`ds.scale_now`).
        flags: The origin check (``None``: not tracked).
        reduced: The check of the reduced gradients (``None``: DeepSpeed's verdict).
        loss: The step's loss sum (``None``: no stats).
        device: Where the vector is assembled: the module's device.
    """

    __slots__ = (
        "_copy",
        "_flags",
        "_host",
        "_on_device",
        "_ready",
        "_reduced_size",
        "_sizes",
        "applied",
        "counters",
        "origin_devices",
        "overflow",
    )

    def __init__(
        self,
        engine: object,
        before: float | torch.Tensor,
        flags: Flags | None,
        reduced: BoundaryGradientFlags | None,
        loss: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        self.overflow = ds.overflow(engine)
        self.applied = bool(engine.was_step_applied())  # type: ignore[attr-defined]
        self.counters = ds.scaler_counters(engine)
        self._flags = flags  # kept for its names: close() may drop the monitor's first
        own = {} if flags is None else flags.take_on_device()
        checked = {} if reduced is None else reduced.take_on_device()
        self.origin_devices = tuple(own)
        self._sizes = [len(vector) for vector in own.values()]
        self._reduced_size = sum(len(vector) for vector in checked.values())
        parts = [*own.values(), *checked.values()]
        values = {
            "norm": ds.grad_norm(engine),
            "before": before,
            "after": ds.scale_now(engine),
            # As the record always read it: a device's loss in float32, a CPU one as it is
            # (float64 holds either exactly).
            "loss": None if loss is None else _as_read(loss.detach()),
        }
        self._host: dict[str, float | None] = {}
        self._on_device: list[str] = []
        for name in _SCALARS:
            value = values[name]
            if isinstance(value, torch.Tensor):
                parts.append(value.reshape(1))
                self._on_device.append(name)
            else:
                self._host[name] = value
        self._copy: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        if parts:
            # float64 holds every part exactly; MPS has no float64 (flags, scales and a
            # float32 loss stay exact in float32; an fp64 norm would round there).
            dtype = torch.float32 if device.type == "mps" else torch.float64
            stacked = torch.cat(
                [p.to(device=device, dtype=dtype, non_blocking=True).reshape(-1) for p in parts]
            )
            self._copy, self._ready = to_host_async(stacked)

    def read(self) -> HostStep:
        """The step's values on the host: waits for the copy (telemetry thread)."""
        if self._ready is not None:
            self._ready.synchronize()
        values: Sequence[float] = [] if self._copy is None else self._copy.tolist()
        at = 0
        own: dict[str, Sequence[float]] = {}
        for device, size in zip(self.origin_devices, self._sizes, strict=True):
            own[device] = values[at : at + size]
            at += size
        reduced = any(value > 0 for value in values[at : at + self._reduced_size])
        at += self._reduced_size
        scalars = dict(self._host)
        for name in self._on_device:
            scalars[name] = values[at]
            at += 1
        origin, named = ({}, {}) if self._flags is None else self._flags.name(own)
        before, after = scalars["before"], scalars["after"]
        return HostStep(
            overflow=self.overflow,
            applied=self.applied,
            before=1.0 if before is None else before,
            after=1.0 if after is None else after,
            norm=scalars["norm"],
            loss=scalars["loss"],
            origin=origin,
            named=named,
            reduced=reduced,
            counters=self.counters,
        )


def _as_read(loss: torch.Tensor) -> torch.Tensor:
    return loss if loss.device.type == "cpu" else loss.float()
