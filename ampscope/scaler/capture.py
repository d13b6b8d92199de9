"""What one iteration saw, captured on the training thread with device ops only.

Between two update() calls a :class:`StepCapture` collects, per device, this rank's
local found-inf (cheap clones taken from the unscale kernel's output), which optimizers
stepped and whether the host already knows they skipped, and, on overflow iterations
only, the non-finite parameter counts. update() then stacks every scalar of the step
into one small tensor and starts its copy to the host (:class:`PendingStep`); the
telemetry thread reads it later.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ampscope.reporter.schema import Identity
from ampscope.scaler import compat


@dataclass(frozen=True, kw_only=True)
class OptimizerSlot:
    """One optimizer's part of a pending step; its found-inf values sit in the step tensor.

    Immutable and shared: a capture reuses one slot per distinct value.
    """

    index: int
    name: str
    fused: bool
    stepped: bool
    num_flags: int
    """How many per-device found-inf values of this optimizer the step tensor holds."""


@dataclass(slots=True, kw_only=True)
class PendingStep:
    """One update()'s scalars on their way to the host, plus what the host already knows.

    A compact row: the training thread fills it and never touches it again; the telemetry
    thread turns it into a record. ``values`` layout, once read: ``[scale_before,
    *optimizer flags, *local flags, scale_after, growth_tracker, *origin flags]``.
    """

    identity: Identity
    step: int
    time: float
    manual: bool
    optimizers: tuple[OptimizerSlot, ...]
    local_devices: tuple[str, ...]
    origin_devices: tuple[str, ...]
    nonfinite: Mapping[str, int]
    values: tuple[torch.Tensor, ...]
    """Accelerators: ``(pinned host copy of all scalars,)``. CPU: ``(before, [scale_after,
    *origin flags] or the 0-dim scale_after when there are none, growth_tracker)``, copies
    made without reading them (cheaper than the conversions one vector would need)."""
    ready: torch.cuda.Event | None = None
    """Recorded after the non-blocking copy into pinned ``values``; ``None`` on CPU."""

    def read(self) -> list[float]:
        """The step's scalars on the host; waits for the device copy (telemetry thread)."""
        if self.ready is not None:
            self.ready.synchronize()
        if len(self.values) == 1:
            values: list[float] = self.values[0].tolist()
            return values
        before, after, tracker = self.values
        if after.dim() == 0:  # the scale alone (no origin flags)
            return [*before.tolist(), after.item(), float(tracker.item())]
        scale_after, *origin = after.tolist()
        return [*before.tolist(), scale_after, float(tracker.item()), *origin]


def to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small device tensor to the host without blocking the caller."""
    if values.device.type == "cpu":
        return values, None
    if values.device.type == "cuda":
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
    # Other accelerators: a plain copy (may synchronise on some backends).
    return values.to("cpu"), None


def _stack(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One float32 vector of 0-dim (or one-element) tensors: a single op for the parts
    already on ``device`` as 0-dim float32 (the scale and found-inf tensors), one more per
    other part (the int32 growth tracker, flags of other devices)."""
    # ``is`` and ``ndim``: dtypes are singletons, and both are cheaper than ``==`` and
    # ``dim()``; this check runs for every part on every update().
    float32 = torch.float32
    return torch.stack(
        [
            p
            if p.dtype is float32 and p.ndim == 0 and p.device == device
            else p.detach().to(device=device, dtype=float32, non_blocking=True).reshape(())
            for p in parts
        ]
    )


@dataclass
class _Iteration:
    local: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizers: dict[int, tuple[torch.optim.Optimizer, bool, bool]] = field(default_factory=dict)
    """id → (optimizer, fused, stepped)."""
    skipped_on_host: bool = False
    unknown_skip: list[torch.Tensor] = field(default_factory=list)
    """Found-inf tensors of fused steps whose outcome the host has not read (accelerators)."""
    nonfinite: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class BeforeUpdate:
    """Scalars that update() is about to change, and which optimizers they belong to.

    Not frozen: built once per update() and never changed, and a frozen dataclass's
    ``__init__`` costs about twice as much.
    """

    values: torch.Tensor
    """``[scale, *optimizer flags, *local flags]``."""
    slots: tuple[tuple[int, int], ...]
    """(id(optimizer), number of flags) in the order of ``values[1:]``."""
    local_devices: tuple[str, ...]


class StepCapture:
    """Per-iteration capture for one scaler; training thread only."""

    def __init__(self) -> None:
        self._iteration = _Iteration()
        # id -> (weak reference, index): cheaper per step than a WeakKeyDictionary; the
        # reference tells a reused id of a collected optimizer from the original.
        self._indices: dict[int, tuple[weakref.ref[torch.optim.Optimizer], int]] = {}
        self._step = 0
        self._last_skipped: bool | PendingStep | None = None
        self._slots: dict[tuple[int, str, bool, bool, int], OptimizerSlot] = {}
        self._device_names: dict[torch.device, str] = {}

    # -- during the iteration ------------------------------------------------------------

    def record_local(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: Mapping[torch.device, torch.Tensor],
        *,
        fresh: bool = False,
    ) -> None:
        """Keep this rank's pre-reduction found-inf per device.

        ``fresh`` says nothing changes the tensors before update() reads them: the
        caller's own copies, or torch's when its scaler does not reduce them in place
        (``torch.amp.GradScaler``). Otherwise (the sharded scaler all-reduces them right
        after) each is cloned: one small op per device.
        """
        self._seen(optimizer, fused=compat.steps_itself(optimizer), stepped=False)
        local = self._iteration.local
        for device, flag in found_inf.items():
            key = self._device_names.get(device)
            if key is None:
                key = self._device_names[device] = str(device)
            previous = local.get(key)
            if previous is None:
                local[key] = flag if fresh else flag.detach().clone()
            else:
                local[key] = torch.maximum(previous, flag.to(previous.device))

    def record_step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        fused: bool,
        skipped: bool | None,
        found_inf: Mapping[torch.device, torch.Tensor] | None = None,
    ) -> None:
        """Note that ``optimizer`` went through step(); ``skipped=None``: host does not know
        (then ``found_inf`` says it, read only if someone asks)."""
        self._seen(optimizer, fused=fused, stepped=True)
        if skipped:
            self._iteration.skipped_on_host = True
        elif skipped is None and found_inf:
            self._iteration.unknown_skip.extend(found_inf.values())

    def add_nonfinite(self, counts: Mapping[str, int]) -> None:
        for name, count in counts.items():
            self._iteration.nonfinite[name] = self._iteration.nonfinite.get(name, 0) + count

    def _seen(self, optimizer: torch.optim.Optimizer, *, fused: bool, stepped: bool) -> None:
        known = self._indices.get(id(optimizer))
        if known is None or known[0]() is not optimizer:
            self._indices[id(optimizer)] = (weakref.ref(optimizer), len(self._indices))
        previous = self._iteration.optimizers.get(id(optimizer))
        stepped = stepped or (previous is not None and previous[2])
        self._iteration.optimizers[id(optimizer)] = (optimizer, fused, stepped)

    def last_step_skipped(self) -> bool:
        """Whether the newest iteration skipped a step: the open one if it has stepped,
        else the one the last update() closed. Free when the host knows (the usual case);
        otherwise reads device flags (a sync) or waits for the pending step."""
        iteration = self._iteration
        if any(stepped for _, _, stepped in iteration.optimizers.values()):
            if iteration.skipped_on_host:
                return True
            return any(bool(flag.item()) for flag in iteration.unknown_skip)
        last = self._last_skipped
        if isinstance(last, PendingStep):
            values = last.read()
            offset, skipped = 1, False
            for slot in last.optimizers:
                found = any(v > 0 for v in values[offset : offset + slot.num_flags])
                skipped = skipped or (slot.stepped and found)
                offset += slot.num_flags
            self._last_skipped = skipped
            return skipped
        return bool(last)

    # -- update() ------------------------------------------------------------------------

    def _slot(
        self, index: int, name: str, fused: bool, stepped: bool, num_flags: int
    ) -> OptimizerSlot:
        key = (index, name, fused, stepped, num_flags)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = OptimizerSlot(
                index=index, name=name, fused=fused, stepped=stepped, num_flags=num_flags
            )
        return slot

    def before_update(self, scaler: torch.amp.GradScaler) -> BeforeUpdate | None:
        """Snapshot the scale, every optimizer's found-inf and this rank's local found-inf
        before update() consumes them: one stack of device scalars."""
        scale = compat.scale_tensor(scaler)
        if scale is None:
            return None
        parts = [scale]
        slots = []
        for key, flags in compat.per_optimizer_found_infs(scaler):
            parts.extend(flags)
            slots.append((key, len(flags)))
        local = self._iteration.local
        parts.extend(local.values())
        return BeforeUpdate(
            values=_stack(parts, scale.device), slots=tuple(slots), local_devices=tuple(local)
        )

    def after_update(
        self,
        scaler: torch.amp.GradScaler,
        before: BeforeUpdate | None,
        *,
        identity: Identity,
        manual: bool,
        origin: Mapping[str, torch.Tensor],
        update_time: float | None = None,
    ) -> PendingStep | None:
        """Close the iteration: stack the step's scalars and start their host copy."""
        iteration, self._iteration = self._iteration, _Iteration()
        scale, tracker = compat.scale_tensor(scaler), compat.growth_tracker(scaler)
        if before is None or scale is None or tracker is None:
            return None
        self._step += 1
        device = scale.device
        values: tuple[torch.Tensor, ...]
        ready = None
        if device.type == "cpu":
            # Nothing is read here: the training thread reads the device no more often
            # than torch's scaler does (tests/scaler/test_scalers.py checks it on the CPU).
            # Without origin flags a clone (0-dim) is about half the cost of a stack.
            after = _stack([scale, *origin.values()], device) if origin else scale.clone()
            values = (before.values, after, tracker.clone())
        else:
            host, ready = to_host_async(
                torch.cat([before.values, _stack([scale, tracker, *origin.values()], device)])
            )
            values = (host,)
        slots = []
        for key, num_flags in before.slots:
            optimizer, fused, stepped = iteration.optimizers.get(key, (None, False, False))
            known = self._indices.get(key)
            index = known[1] if known is not None and known[0]() is optimizer else -1
            name = type(optimizer).__name__ if optimizer is not None else "unknown"
            slots.append(self._slot(max(index, 0), name, fused, stepped, num_flags))
        pending = PendingStep(
            identity=identity,
            step=self._step,
            time=update_time if update_time is not None else time.time(),
            manual=manual,
            optimizers=tuple(slots),
            local_devices=before.local_devices,
            origin_devices=tuple(origin),
            nonfinite=iteration.nonfinite,  # the iteration object is not reused
            values=values,
            ready=ready,
        )
        stepped = any(s for _, _, s in iteration.optimizers.values())
        if iteration.skipped_on_host:
            self._last_skipped = True
        elif not stepped or not iteration.unknown_skip:
            self._last_skipped = False
        else:
            self._last_skipped = pending
        return pending
