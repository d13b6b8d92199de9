"""What one iteration saw, captured on the training thread at the least cost.

A :class:`StepCapture` hooks in at two points. When torch unscales an optimizer's
gradients it notes the optimizer and how often its ``step()`` has run so far (a step
pre-hook counts the calls), and keeps this rank's local found-inf where torch's differs
(the sharded scaler reduces it in place; DTensor gradients are unscaled shard by shard).
At update() it hands a :class:`PendingStep` to the telemetry thread, which names the
step's values (optimizer slots, device names) and builds the record.

torch's ``step()`` already read each optimizer's found-inf on the host (its ``.item()``)
and called ``optimizer.step()`` only if it was zero. So when every optimizer of the
iteration has stepped and its counter moved, every found-inf value is known to be zero,
and none is copied or read. What remains is the scale before and after update() and the
growth tracker:

* **CPU** (host transport): read at once with no copy; reading CPU memory is no device
  synchronisation.
* **Accelerators** (device transport): the scale and tracker after update() are stacked
  into one small tensor whose copy to pinned host memory starts without blocking. The
  scale before is the previous step's scale after, which the tensor's version counter
  proves unchanged. Nothing is read on the training thread.

An iteration the host cannot vouch for (a skipped step, a fused optimizer, whose skip is
decided on the device, an optimizer unscaled but not stepped, a changed scale) also
snapshots the scale and every found-inf value before update(), which adds the tensors
into the first one in place; skipped steps get their non-finite parameters counted then.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from ampscope.rank import compat
from ampscope.reporter.schema import Identity, Setup

if TYPE_CHECKING:
    from ampscope.rank.gradients.stats import TakenStats

_NO_COUNTS: Mapping[str, int] = MappingProxyType({})

FoundInf = Mapping[torch.device, torch.Tensor]

_NO_LOCAL: Mapping[int, FoundInf] = MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class OptimizerSlot:
    """One optimizer's part of a pending step; its found-inf values sit in the step's values.

    Immutable and shared: a capture reuses one slot per distinct value.
    """

    index: int
    name: str
    fused: bool
    stepped: bool
    num_flags: int
    """How many per-device found-inf values of this optimizer the step's values hold."""


def _counter(calls: list[int]) -> Callable[[Any, Any, Any], None]:
    # Closes over the counter only: the optimizer's hook holds no capture or scaler.
    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls[0] += 1

    return hook


class OptimizerInfo:
    """What a capture knows of one optimizer across iterations (training thread only)."""

    __slots__ = (
        "calls",
        "counted",
        "dtensor",
        "dtypes",
        "fused",
        "groups",
        "handle",
        "index",
        "name",
        "norm_plan",
        "place",
        "ref",
        "unscaled_at",
    )

    def __init__(
        self, optimizer: torch.optim.Optimizer, index: int, *, count_steps: bool = True
    ) -> None:
        self.ref = weakref.ref(optimizer)
        self.index = index
        self.name = type(optimizer).__name__
        self.fused = compat.steps_itself(optimizer)
        self.calls = [0]
        """``optimizer.step()`` calls so far (public step pre-hook)."""
        self.unscaled_at = 0
        """``calls`` when torch last unscaled the optimizer's gradients."""
        register = getattr(optimizer, "register_step_pre_hook", None) if count_steps else None
        self.handle: RemovableHandle | None = (
            register(_counter(self.calls)) if register is not None else None
        )
        self.counted = not self.fused and self.handle is not None
        """Whether ``calls`` tells a skipped step: torch calls a non-fused optimizer's
        ``step()`` only when its found-inf is zero (fused ones step, and skip, themselves)."""
        self.groups = -1
        """How many parameter groups ``dtensor`` was decided for."""
        self.dtensor = False
        """Whether the optimizer's gradients are DTensors (FSDP2, tensor parallelism).
        Decided from the parameters, again only when a parameter group is added: a DTensor
        parameter's gradient is a DTensor and a plain one's is plain (autograd refuses a
        gradient of another type), so no per-step walk over gradients."""
        self.dtypes: frozenset[str] = frozenset()
        """Names of the parameters' dtypes, which are their gradients' (autograd keeps a
        gradient in its parameter's dtype); decided with ``dtensor``."""
        self.norm_plan: Any = None
        """How the gradient norms (``stats``) read this optimizer's gradients
        (:class:`~ampscope.rank.gradients.stats.NormPlan`), kept by the stats."""
        self.place: tuple[torch.device, torch.dtype] | None = None
        """The one device and dtype of every parameter, hence of every gradient (plain
        tensors only); ``None`` when they differ or are DTensors."""

    def refresh(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        self.groups = len(groups)
        params = [p for group in groups for p in group["params"]]
        self.dtensor = any(compat.is_dtensor(p) for p in params)
        self.dtypes = frozenset(dtype_name(p.dtype) for p in params)
        places = {(p.device, p.dtype) for p in params}
        self.place = places.pop() if len(places) == 1 and not self.dtensor else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def grad_dtype(dtypes: frozenset[str]) -> str | None:
    """The records' ``grad_dtype`` of a set of dtype names: ``"bfloat16"``, several joined
    by ``+`` in name order, ``None`` when there is none."""
    return "+".join(sorted(dtypes)) or None


Step = tuple[int, bool, FoundInf]
"""One optimizer of an iteration: (id, whether torch stepped it, found-inf per device)."""

Shape = tuple["StepCapture", list[Step], dict[int, OptimizerInfo], Mapping[int, FoundInf]]
"""The raw facts of one iteration that name its values, turned into optimizer slots and
device names on the telemetry thread (:meth:`StepCapture.layout`): the capture, the
optimizers in the order update() reads them, those unscaled in the iteration by id, and
the recorded local found-inf by id."""


class PendingStep:
    """One update()'s scalars, on the host or on their way there, plus what the host knows.

    The training thread fills it and never touches it again; the telemetry thread turns
    it into a record. :meth:`read` gives the values in the layout ``[scale_before,
    *optimizer flags, *local flags, scale_after, growth_tracker, *origin flags]``, and
    on the device transport the stats' scalars after them (their per-parameter norms
    stay apart: ``host_norms``; on the host transport ``stats`` holds CPU tensors).
    A plain class with positional arguments first: built on every update(), where a
    dataclass's keyword ``__init__`` costs over twice as much.
    """

    __slots__ = (
        "before",
        "clean",
        "extra",
        "fill",
        "fp8",
        "host",
        "host_extra",
        "host_norms",
        "identity",
        "local_devices",
        "manual",
        "nonfinite",
        "optimizers",
        "origin_devices",
        "ready",
        "setup",
        "shape",
        "snapshot",
        "stats",
        "step",
        "time",
        "values",
    )

    def __init__(
        self,
        identity: Identity,
        step: int,
        time: float,
        manual: bool,
        shape: Shape | None = None,
        clean: bool = False,
        *,
        nonfinite: Mapping[str, int] = _NO_COUNTS,
        optimizers: tuple[OptimizerSlot, ...] = (),
        local_devices: tuple[str, ...] = (),
        origin_devices: tuple[str, ...] = (),
        values: list[float] | None = None,
    ) -> None:
        self.identity = identity
        self.step = step
        self.time = time
        self.manual = manual
        self.shape = shape
        """Set until :meth:`read` fills ``optimizers`` and ``local_devices`` from it."""
        self.clean = clean
        """Every found-inf value is zero and ``values``/``host`` hold only
        ``[scale_after, growth_tracker, *origin flags]``; the scale before is ``before``."""
        self.nonfinite = nonfinite
        self.optimizers = optimizers
        self.local_devices = local_devices
        self.origin_devices = origin_devices
        self.values = values
        """Host transport: the values, already read (only the tail when ``clean``)."""
        self.host: torch.Tensor | None = None
        """Device transport: the values' host copy (pinned on CUDA; only the tail when
        ``clean``)."""
        self.ready: torch.cuda.Event | None = None
        """Recorded after the non-blocking copy into ``host``; ``None`` when complete."""
        self.before: float | tuple[torch.Tensor, int] = 0.0
        """When ``clean``: the scale before update(), or where an earlier step's host
        copy holds it (device transport)."""
        self.snapshot: torch.Tensor | None = None
        """Device transport, not clean, between before and after update(): ``[scale,
        *optimizer flags, *local flags]`` stacked on the device."""
        self.setup: Setup | None = None
        """What the rank runs; a scaler's is named from ``shape`` by :meth:`read`."""
        self.stats: TakenStats | None = None
        """The loss and gradient norms' tensors and layout; ``None`` with ``stats=False``."""
        self.host_norms: torch.Tensor | None = None
        """Device transport: the tail of ``host`` holding the per-parameter norms, read
        only on a spike iteration; the values stop before it."""
        self.fill: tuple[Any, ...] | None = None
        """A watch's host transport: ``(capture, *args)``; :meth:`read` first calls
        ``capture.fill(self, *args)`` (telemetry thread), which sets the layout, the setup
        and ``values``."""
        # Extra device values that travel with the step's own copy, apart from its layout
        # (FP8 observations, ampscope.rank.fp8); the capture never looks inside them.
        self.extra: torch.Tensor | None = None
        """A float32 vector set by the front-end before the copy starts; on the host
        transport (CPU) it is read as it is."""
        self.host_extra: torch.Tensor | None = None
        """Device transport: the tail of ``host`` holding ``extra``."""
        self.fp8: Any = None
        """What names ``extra``'s values (``ampscope.rank.fp8.observer.Fp8Taken``)."""

    def read(self) -> list[float]:
        """The step's scalars on the host; waits for the device copy (telemetry thread)."""
        if self.fill is not None:
            capture, *args = self.fill
            self.fill = None
            capture.fill(self, *args)
        if self.shape is not None:
            self.optimizers, self.local_devices = self.shape[0].layout(self.shape)
            self.setup = self.shape[0].setup(self.shape)
            self.shape = None
        if self.ready is not None:
            # Events complete in order: an earlier step's copy (``before``) is done too.
            self.ready.synchronize()
        own: list[float]
        if self.values is not None:
            own = self.values
        else:
            assert self.host is not None
            host = self.host
            tail = len(self.host_norms) if self.host_norms is not None else 0
            tail += len(self.host_extra) if self.host_extra is not None else 0
            if tail:
                host = host[: len(host) - tail]
            own = host.tolist()
        if not self.clean:
            return own
        before = self.before
        if isinstance(before, tuple):
            earlier, index = before
            before = earlier[index].item()
        zeros = sum(s.num_flags for s in self.optimizers) + len(self.local_devices)
        return [before, *([0.0] * zeros), *own]

    def read_extra(self) -> list[float]:
        """``extra``'s values on the host; call after :meth:`read` (telemetry thread)."""
        if self.host_extra is not None:
            return self.host_extra.tolist()
        return [] if self.extra is None else self.extra.tolist()


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


def copy_with_norms(
    pending: PendingStep, values: torch.Tensor, stats: TakenStats | None
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the host copy of ``values`` (the step's stacked scalars) followed by the
    stats' per-parameter norms, if any, and ``pending.extra``, if set: one stack and one
    cat more, still one copy. Sets ``pending.host_norms`` and ``pending.host_extra`` to
    their parts of the host copy."""
    extra = pending.extra
    norm_count = stats.norm_count() if stats is not None else 0
    if not norm_count and extra is None:
        return to_host_async(values)
    device, float32 = values.device, torch.float32
    parts = [values]
    if stats is not None and norm_count:
        for optimizer in stats.optimizers:
            if optimizer.norms:
                # One stack per optimizer (its norms share a device); a cast only when they
                # are not float32 on the values' device.
                stacked = torch.stack(optimizer.norms)
                if stacked.dtype is not float32 or stacked.device != device:
                    stacked = stacked.to(device=device, dtype=float32, non_blocking=True)
                parts.append(stacked)
    if extra is not None:
        if extra.dtype is not float32 or extra.device != device:
            extra = extra.to(device=device, dtype=float32, non_blocking=True)
        parts.append(extra)
    host, ready = to_host_async(torch.cat(parts))
    end = len(host)
    if extra is not None:
        pending.host_extra = host[end - len(extra) :]
        end -= len(extra)
    if norm_count:
        pending.host_norms = host[end - norm_count : end]
    return host, ready


def stack_scalars(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One float32 vector of 0-dim (or one-element) tensors: a single op for the parts
    already on ``device`` as 0-dim float32 (the scale and found-inf tensors), one more per
    other part (the int32 growth tracker, flags of other devices)."""
    float32 = torch.float32
    return torch.stack(
        [
            p
            if p.dtype is float32 and p.ndim == 0 and p.device == device
            else p.detach().to(device=device, dtype=float32, non_blocking=True).reshape(())
            for p in parts
        ]
    )


class StepCapture:
    """Per-iteration capture for one scaler; training thread only, except :meth:`layout`.

    Args:
        read_on_host: Read the step's values at update() (the host transport). ``None``:
            when the scale lives on the CPU. Tests pass ``False`` to run the device
            transport on the CPU.
    """

    def __init__(self, read_on_host: bool | None = None) -> None:
        self._read_on_host = read_on_host
        self._optimizers: dict[int, OptimizerInfo] = {}
        # This iteration's, replaced by update():
        self._seen: dict[int, OptimizerInfo] = {}
        """Optimizers unscaled in this iteration, by id."""
        self._local: dict[int, FoundInf] = {}
        # Across iterations:
        self._step = 0
        self._skipped: bool | None = False
        """Whether the iteration that update() is closing skipped a step; ``None``: the
        host does not know (set before torch's update, kept by after_update)."""
        self._last_skipped: bool | PendingStep = False
        self._slots: dict[tuple[int, str, bool, bool, int], OptimizerSlot] = {}
        self._device_names: dict[torch.device, str] = {}
        self._setups: dict[frozenset[str], Setup] = {}
        self._scale_seen: tuple[torch.Tensor, int] | None = None
        """The scale tensor and its version right after the previous update()'s capture."""
        self._scale_at: tuple[torch.Tensor, int] | None = None
        """Device transport: where that capture's scale after update() sits on the host."""

    def close(self) -> None:
        """Remove the step pre-hooks from every optimizer still alive."""
        for info in self._optimizers.values():
            if info.handle is not None:
                info.handle.remove()
        self._optimizers.clear()

    # -- during the iteration ------------------------------------------------------------

    def unscaling(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        """Note that torch is unscaling ``optimizer``'s gradients in this iteration
        (registering it, with its step pre-hook, on first sight); what is known of it
        (``dtensor``: whether its gradients are DTensors)."""
        key = id(optimizer)
        info = self._optimizers.get(key)
        if info is None or info.ref() is not optimizer:
            # A reused id of a collected optimizer gets a fresh entry and index.
            info = self._optimizers[key] = OptimizerInfo(optimizer, len(self._optimizers))
        self._seen[key] = info
        info.unscaled_at = info.calls[0]
        if len(optimizer.param_groups) != info.groups:
            info.refresh(optimizer)
        return info

    def record_local(
        self, optimizer: torch.optim.Optimizer, found_inf: FoundInf, *, fresh: bool
    ) -> None:
        """Keep this rank's pre-reduction found-inf per device, where it differs from what
        torch keeps: an optimizer's found-inf not recorded here is torch's own.

        ``fresh`` says nothing changes the tensors before update() reads them (the
        caller's own copies). Otherwise (the sharded scaler all-reduces them in place
        right after) each is cloned: one small op per device.
        """
        if not fresh:
            found_inf = {d: t.detach().clone() for d, t in found_inf.items()}
        self._local[id(optimizer)] = found_inf

    def skips(self, steps: list[Step], *, read_device: bool) -> dict[int, bool | None]:
        """Whether each stepped optimizer skipped its step, by id; ``None``: unknown.

        torch called a non-fused optimizer's ``step()`` only if its found-inf was zero,
        so the step counter says it for free. Fused optimizers step themselves and skip
        on the device: their found-inf is read when it is on the CPU (free) or when
        ``read_device`` (a sync on accelerators).
        """
        out: dict[int, bool | None] = {}
        for key, stepped, found_inf in steps:
            if not stepped:
                continue
            info = self._seen.get(key)
            if info is not None and info.counted:
                out[key] = info.calls[0] == info.unscaled_at
            elif read_device or all(t.device.type == "cpu" for t in found_inf.values()):
                out[key] = any(bool(t.item()) for t in found_inf.values())
            else:
                out[key] = None
        return out

    def last_step_skipped(self, scaler: torch.amp.GradScaler) -> bool:
        """Whether the newest iteration skipped a step: the open one if it has stepped,
        else the one the last update() closed. Free when the host knows (the usual case);
        otherwise reads device flags (a sync) or waits for the pending step."""
        _, steps = compat.update_inputs(scaler)
        if any(stepped for _, stepped, _ in steps):
            return any(self.skips(steps, read_device=True).values())
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
        return last

    # -- update() ------------------------------------------------------------------------

    def before_update(
        self,
        scaler: torch.amp.GradScaler,
        identity: Identity,
        manual: bool,
        attribute: Callable[[torch.optim.Optimizer], Mapping[str, int]] | None,
    ) -> PendingStep | None:
        """The step, with what update() will consume. A clean iteration costs a read of
        the scale (CPU) or nothing (accelerators); any other snapshots every found-inf
        value, and counts the non-finite parameters of skipped steps with ``attribute``.
        ``None`` before the first ``scale()``."""
        scale, steps = compat.update_inputs(scaler)
        if scale is None:
            return None
        seen = self._seen
        clean = True
        for key, stepped, _ in steps:
            info = seen.get(key)
            # Known clean: torch stepped the optimizer and its counted step() ran.
            if not stepped or info is None or not info.counted or info.calls[0] == info.unscaled_at:
                clean = False
                break
        # An empty _local is kept for the next iteration: hand out an immutable one.
        shape: Shape = (self, steps, seen, self._local or _NO_LOCAL)
        pending = PendingStep(identity, self._step + 1, time.time(), manual, shape, clean)
        if clean:
            self._skipped = False
        else:
            self._unclean(pending, steps, attribute)
        on_host = self._read_on_host
        if on_host is None:  # decided once: a scaler's device never changes
            on_host = self._read_on_host = scale.device.type == "cpu"
        if on_host:
            if clean:
                pending.before, pending.values = scale.item(), []
            else:
                flags = self._flag_tensors(shape)
                pending.values = [scale.item(), *(flag.item() for flag in flags)]
            return pending
        seen_scale, at = self._scale_seen, self._scale_at
        if (
            clean
            and at is not None
            and seen_scale is not None
            and seen_scale[0] is scale
            and compat.tensor_version(scale) == seen_scale[1]
        ):
            pending.before = at
        else:
            pending.clean = False
            flags = self._flag_tensors(shape)
            pending.snapshot = stack_scalars([scale, *flags], scale.device)
        return pending

    def _unclean(
        self,
        pending: PendingStep,
        steps: list[Step],
        attribute: Callable[[torch.optim.Optimizer], Mapping[str, int]] | None,
    ) -> None:
        skips = self.skips(steps, read_device=False)
        self._skipped = True if any(skips.values()) else None if None in skips.values() else False
        if attribute is None:
            return
        nonfinite: dict[str, int] = {}
        for key, skipped in skips.items():
            info = self._seen.get(key)
            optimizer = info.ref() if info is not None else None
            if skipped and optimizer is not None:
                for name, count in attribute(optimizer).items():
                    nonfinite[name] = nonfinite.get(name, 0) + count
        if nonfinite:
            pending.nonfinite = nonfinite

    def after_update(
        self,
        scaler: torch.amp.GradScaler,
        pending: PendingStep | None,
        origin: Mapping[str, torch.Tensor],
        stats: TakenStats | None = None,
    ) -> PendingStep | None:
        """Close the iteration: read the step's scalars (CPU) or start their host copy;
        ``stats`` travel with them (their per-parameter norms only in the copy)."""
        self._seen = {}
        if self._local:
            self._local = {}
        scale, tracker = compat.scale_and_tracker(scaler)
        if pending is None or scale is None or tracker is None:
            self._scale_seen = self._scale_at = None
            self._last_skipped = False
            return None
        self._step = pending.step
        if origin:
            pending.origin_devices = tuple(origin)
        pending.stats = stats
        values = pending.values
        if values is not None:  # the host transport
            values.append(scale.item())
            values.append(float(tracker.item()))
            if origin:
                values.extend(flag.item() for flag in origin.values())
            # The stats' tensors stay as they are: the telemetry thread reads them.
        else:
            parts = [scale, tracker, *origin.values()]
            if stats is not None:
                parts += stats.scalars()
            after = stack_scalars(parts, scale.device)
            snapshot, pending.snapshot = pending.snapshot, None
            if snapshot is None:
                host, ready = copy_with_norms(pending, after, stats)
                index = 0
            else:
                host, ready = copy_with_norms(pending, torch.cat([snapshot, after]), stats)
                index = len(snapshot)
            pending.host, pending.ready = host, ready
            self._scale_at = (host, index)
            self._scale_seen = (scale, compat.tensor_version(scale))
        self._last_skipped = pending if self._skipped is None else self._skipped
        return pending

    # -- naming the values ---------------------------------------------------------------

    def layout(self, shape: Shape) -> tuple[tuple[OptimizerSlot, ...], tuple[str, ...]]:
        """The optimizer slots and local device names of an iteration, in the order of its
        values. Runs on the telemetry thread, reading only the iteration's own objects and
        this capture's caches (dict lookups and inserts, atomic under the GIL)."""
        _, steps, seen, _ = shape
        slots = []
        for key, stepped, found_inf in steps:
            info = seen.get(key) or self._optimizers.get(key)
            if info is None:
                slot_key = (0, "unknown", False, stepped, len(found_inf))
            else:
                slot_key = (info.index, info.name, info.fused, stepped, len(found_inf))
            slot = self._slots.get(slot_key)
            if slot is None:
                index, name, fused, was_stepped, num_flags = slot_key
                slot = self._slots[slot_key] = OptimizerSlot(
                    index=index, name=name, fused=fused, stepped=was_stepped, num_flags=num_flags
                )
            slots.append(slot)
        return tuple(slots), tuple(self._local_flags(shape))

    def setup(self, shape: Shape) -> Setup:
        """A scaler's setup: it skips, checking the dtypes of the iteration's optimizers'
        gradients. Telemetry thread; one shared object per dtype combination."""
        _, steps, seen, _ = shape
        dtypes: frozenset[str] = frozenset()
        for key, _, _ in steps:
            info = seen.get(key) or self._optimizers.get(key)
            if info is not None:
                dtypes |= info.dtypes
        setup = self._setups.get(dtypes)
        if setup is None:
            setup = self._setups[dtypes] = Setup(
                mode="scaler", policy="skip", grad_dtype=grad_dtype(dtypes)
            )
        return setup

    def _local_flags(self, shape: Shape) -> dict[str, list[torch.Tensor]]:
        """This rank's found-inf tensors by device name: each optimizer's recorded local
        ones, else torch's own (equal to local where torch does not reduce them)."""
        names = self._device_names
        local: dict[str, list[torch.Tensor]] = {}
        _, steps, _, recorded = shape
        for key, _, found_inf in steps:
            for device, flag in recorded.get(key, found_inf).items():
                name = names.get(device)
                if name is None:
                    name = names[device] = str(device)
                local.setdefault(name, []).append(flag)
        return local

    def _flag_tensors(self, shape: Shape) -> list[torch.Tensor]:
        """Every found-inf tensor in the values' order; one per local device (the max)."""
        flags = [flag for _, _, found_inf in shape[1] for flag in found_inf.values()]
        for tensors in self._local_flags(shape).values():
            merged = tensors[0]
            for flag in tensors[1:]:
                merged = torch.maximum(merged, flag.to(merged.device))
            flags.append(merged)
        return flags
