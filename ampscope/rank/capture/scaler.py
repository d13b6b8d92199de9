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
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from ampscope.rank import compat
from ampscope.rank.capture import layout
from ampscope.rank.capture.pending import PendingStep, copy_with_norms, stack_scalars
from ampscope.rank.capture.registry import CaptureRegistry, OptimizerInfo
from ampscope.rank.gradients.nonfinite import FoundInf, max_per_device
from ampscope.reporter.schema import Identity

if TYPE_CHECKING:
    from ampscope.rank.gradients.stats import TakenStats

_NO_LOCAL: Mapping[int, FoundInf] = MappingProxyType({})

Step = tuple[int, bool, FoundInf]
"""One optimizer of an iteration: (id, whether torch stepped it, found-inf per device)."""


class StepCapture:
    """Per-iteration capture for one scaler; training thread only, except :meth:`lay_out`.

    Args:
        read_on_host: Read the step's values at update() (the host transport). ``None``:
            when the scale lives on the CPU. Tests pass ``False`` to run the device
            transport on the CPU.
    """

    def __init__(self, read_on_host: bool | None = None) -> None:
        self._read_on_host = read_on_host
        self._registry = CaptureRegistry(mode="scaler", policy="skip", count_steps=True)
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
        self._scale_seen: tuple[torch.Tensor, int] | None = None
        """The scale tensor and its version right after the previous update()'s capture."""
        self._scale_at: tuple[torch.Tensor, int] | None = None
        """Device transport: where that capture's scale after update() sits on the host."""

    @property
    def registry(self) -> CaptureRegistry:
        """The optimizers and shared record parts (the front-end names the origin group)."""
        return self._registry

    def flags_on_host(self, found_per_device: FoundInf) -> bool:
        """Whether this iteration's found-inf flags are host memory, read without a sync:
        the host transport (a CPU scaler), or, before the first update() decides it, every
        flag on the CPU."""
        if self._read_on_host is not None:
            return self._read_on_host
        return all(flag.device.type == "cpu" for flag in found_per_device.values())

    def close(self) -> None:
        """Remove the step pre-hooks from every optimizer still alive."""
        self._registry.close()

    # -- during the iteration ------------------------------------------------------------

    def unscaling(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        """Note that torch is unscaling ``optimizer``'s gradients in this iteration
        (registering it, with its step pre-hook, on first sight); what is known of it
        (``dtensor``: whether its gradients are DTensors)."""
        info = self._registry.info(optimizer)
        self._seen[id(optimizer)] = info
        info.unscaled_at = info.calls[0]
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
            skipped = layout.decode(
                values, last.optimizers, last.local_devices, last.origin_devices
            ).stepped_on_nonfinite
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
        local = self._local or _NO_LOCAL
        pending = PendingStep(
            identity, self._step + 1, time.time(), manual, (self, steps, seen, local), clean
        )
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
                flags = self._flag_tensors(steps, local)
                pending.values = layout.head(scale.item(), [flag.item() for flag in flags])
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
            flags = self._flag_tensors(steps, local)
            pending.snapshot = stack_scalars(layout.head(scale, flags), scale.device)
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
        # Every update() counts, recorded or not (before_update may have failed): the
        # records' steps stay the same on every rank.
        self._step += 1
        scale, tracker = compat.scale_and_tracker(scaler)
        if pending is None or scale is None or tracker is None:
            self._scale_seen = self._scale_at = None
            self._last_skipped = False
            return None
        if origin:
            pending.origin_devices = tuple(origin)
        pending.stats = stats
        values = pending.values
        if values is not None:  # the host transport
            origin_values = [flag.item() for flag in origin.values()] if origin else ()
            values += layout.tail(scale.item(), float(tracker.item()), origin_values)
            # The stats' tensors stay as they are: the telemetry thread reads them.
        else:
            parts = layout.tail(scale, tracker, origin.values())
            if stats is not None:
                parts += stats.scalars()
            after = stack_scalars(parts, scale.device)
            snapshot, pending.snapshot = pending.snapshot, None
            if snapshot is None:
                host, ready = copy_with_norms(pending, after, stats)
                index = layout.SCALE_AFTER
            else:
                host, ready = copy_with_norms(pending, torch.cat([snapshot, after]), stats)
                index = len(snapshot) + layout.SCALE_AFTER
            pending.host, pending.ready = host, ready
            self._scale_at = (host, index)
            self._scale_seen = (scale, compat.tensor_version(scale))
        self._last_skipped = pending if self._skipped is None else self._skipped
        return pending

    # -- naming the values ---------------------------------------------------------------

    def lay_out(
        self,
        pending: PendingStep,
        steps: list[Step],
        seen: Mapping[int, OptimizerInfo],
        local: Mapping[int, FoundInf],
    ) -> None:
        """Name the step's values: its optimizer slots and local device names, in the order
        of its values, and its setup (a scaler skips; the dtypes of the iteration's
        optimizers' gradients). Runs on the telemetry thread (:meth:`PendingStep.read`),
        reading only the iteration's own objects and the registry (dict lookups and
        inserts, atomic under the GIL)."""
        registry = self._registry
        slots = []
        dtypes: frozenset[str] = frozenset()
        for key, stepped, found_inf in steps:
            info = seen.get(key) or registry.known(key)
            slots.append(registry.slot(info, stepped, len(found_inf)))
            if info is not None:
                dtypes |= info.dtypes
        pending.optimizers = tuple(slots)
        pending.local_devices = registry.device_names(_local_devices(steps, local))
        pending.setup = registry.setup(dtypes)

    def _flag_tensors(self, steps: list[Step], local: Mapping[int, FoundInf]) -> list[torch.Tensor]:
        """The flags of the layout's head: every found-inf tensor of every optimizer, then
        one per local device (their max)."""
        flags = [flag for _, _, found_inf in steps for flag in found_inf.values()]
        flags.extend(max_per_device(_local_founds(steps, local)).values())
        return flags


def _local_founds(steps: list[Step], local: Mapping[int, FoundInf]) -> list[FoundInf]:
    """This rank's found-inf of each optimizer: its recorded local one, else torch's own
    (equal to local where torch does not reduce them)."""
    return [local.get(key, found_inf) for key, _, found_inf in steps]


def _local_devices(steps: list[Step], local: Mapping[int, FoundInf]) -> dict[torch.device, None]:
    """The local flags' devices, in the order of the values."""
    devices: dict[torch.device, None] = {}
    for key, _, found_inf in steps:  # _local_founds, without its list
        devices.update(dict.fromkeys(local.get(key, found_inf)))
    return devices
