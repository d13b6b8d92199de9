"""What one iteration of a :class:`~ampscope.GradWatch` saw, captured at the least cost.

Per optimizer, the front-end runs :func:`~ampscope.rank.gradients.nonfinite.check_local`:
torch's fused multi-tensor non-finite kernel (the one its unscale runs) once per (device,
dtype) group of this rank's local gradients (DTensor shards, under FSDP2 and tensor
parallelism) with an inverse scale of 1: one pass over gradient memory (the kernel
writes each value back unchanged), no sync. Its one-element flags stay on the device. On
the CPU with the gradient norms on (``stats``), the norms, taken first, decide a clean
iteration alone (:meth:`WatchCapture.clean_from_norms`): an inf/NaN element always makes its norm
non-finite, so finite norms spare the kernel; a non-finite norm (which finite elements
above ~1.8e19 also give, in float32) leaves the decision to it.

Under ``skip`` and ``raise``, :func:`agree` max-reduces them into one flag with a single
all-reduce on the watch's process group, so that every rank decides alike. Under
``observe`` nothing more happens until update(), which hands the flags to the telemetry
thread the way the scalers' capture does: on the CPU the telemetry thread lays the
step out and reads them (host memory, no sync; nothing writes them any more), else they
are stacked and copied to pinned memory without blocking.

The values follow the scalers' :mod:`~ampscope.rank.capture.layout`, with a scale of 1
and a tracker of 0, so one :class:`~ampscope.rank.telemetry.records.RecordBuilder` builds
both kinds of record; the pending step's :class:`~ampscope.reporter.schema.Setup` tells
it which kind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ampscope.rank.capture import layout
from ampscope.rank.capture.pending import PendingStep, copy_with_norms, stack_scalars
from ampscope.rank.capture.registry import CaptureRegistry, OptimizerInfo
from ampscope.rank.gradients.nonfinite import FoundInf, max_of, max_per_device
from ampscope.rank.telemetry.identity import collective_device
from ampscope.reporter.schema import Identity, Policy

if TYPE_CHECKING:
    from ampscope.rank.gradients.stats import TakenStats

_READ_EACH = 8
"""Up to this many norms, reading each costs less than stacking them first."""


class Checked:
    """One optimizer's check in the open iteration (training thread only)."""

    __slots__ = ("agreed", "found", "info", "nonfinite", "skipped", "stepped")

    def __init__(
        self, info: OptimizerInfo | None, found: FoundInf, agreed: torch.Tensor | None
    ) -> None:
        self.info = info
        """``None`` when the capture could not register the optimizer (the check then took
        part as clean)."""
        self.found = found
        """This rank's local flag per device."""
        self.agreed = agreed
        """The flag every rank agreed on (``skip``, ``raise``); ``None`` under observe."""
        self.stepped = False
        """``step()`` was called for the optimizer (whatever the policy then did)."""
        self.skipped: bool | None = False
        """The step was skipped; ``None``: a fused optimizer skipped it, or not, on the
        device (flag not read)."""
        self.nonfinite: Mapping[str, int] | None = None
        """Non-finite element counts by parameter, once counted."""


def agree(
    found: FoundInf, group: dist.ProcessGroup | None, failed: Callable[[], None]
) -> torch.Tensor:
    """One flag, 1 when any rank of ``group`` found inf/NaN: the local flags' max, then one
    all-reduce (max) of that one-element tensor when the process group has several ranks.
    A rank with no gradients still takes part, with a zero flag; so does a rank whose
    local max fails (``failed()`` is called in its ``except``): no rank waits alone. The
    local flags stay unchanged (the all-reduce works on a copy)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    flags = list(found.values())
    flag = None
    if flags:
        try:
            flag = max_of(flags)
            if distributed and len(flags) == 1:
                flag = flag.clone()  # the all-reduce writes it
        except Exception:
            failed()
            flag = None
    if flag is None:
        device = collective_device(group) if distributed else torch.device("cpu")
        flag = torch.zeros(1, dtype=torch.float32, device=device)
    if distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


class WatchCapture:
    """Per-iteration state of one watch; training thread only.

    Args:
        policy: The watch's policy (named in every record's setup).
        read_on_host: Read the values at update() (host transport). ``None``: when every
            flag is on the CPU. Tests pass ``False`` to run the device transport on CPU.
    """

    def __init__(self, policy: Policy, read_on_host: bool | None = None) -> None:
        self.policy = policy
        self._read_on_host = read_on_host
        self._registry = CaptureRegistry(mode="watch", policy=policy, count_steps=False)
        self.iteration: dict[int, Checked] = {}
        """The open iteration's checks by optimizer id, in the order they ran."""
        self.step = 0
        """update() calls (and iterations closed by a raise) so far."""
        self.closed_by_raise = False
        """A raise closed the iteration: the update() a loop may still call closes none."""
        self.last_skipped: bool | list[torch.Tensor] = False
        """Whether the last closed iteration skipped; flags to read when the host does
        not know (fused optimizers under skip)."""
        self.ones: dict[torch.device, torch.Tensor] = {}
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self.zero_ids: set[int] = set()
        """``id()`` of the shared clean flags (:meth:`clean_from_norms`): known to be 0,
        so never read."""
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def registry(self) -> CaptureRegistry:
        """The optimizers and shared record parts (the front-end names the origin group)."""
        return self._registry

    def clean_from_norms(
        self, norms: tuple[torch.Tensor, ...] | torch.Tensor, device: torch.device
    ) -> dict[torch.device, torch.Tensor] | None:
        """The found-inf of gradients on the CPU whose norms (one per gradient, every
        element counted; 0-dim tensors or one vector) were just taken, without the
        non-finite kernel: when every norm is finite no element is inf/NaN (one would
        make its norm inf or NaN), and the flag is this capture's zero on ``device``.
        ``None`` when some norm is not finite: that may come from finite elements too (a
        float32 square overflows above ~1.8e19), so the kernel must decide. Reads the
        norms on the host: only for CPU tensors (no sync), and never when the capture is
        told to use the device transport (which stands for an accelerator in tests):
        then ``None``.

        The zero flag is shared by every clean iteration: nothing writes a flag in place
        (:func:`agree` reduces a copy; records read them).
        """
        if self._read_on_host is False:
            return None
        if isinstance(norms, torch.Tensor):
            total = sum(norms.tolist())
        elif len(norms) <= _READ_EACH:
            total = sum([norm.item() for norm in norms])
        else:
            total = sum(torch.stack(norms).tolist())
        # float64 sums of float32 norms do not overflow; wider norms may (then: the kernel).
        if not math.isfinite(total):
            return None
        return {device: self.zero(device)}

    def flags_on_host(self, found: FoundInf, place: torch.device | None) -> bool:
        """Whether this check's local flags are host memory, read without a sync: the
        gradients' one ``place`` is the CPU (none: every flag is on the CPU), unless the
        capture was told its transport (``read_on_host``: tests force the device transport
        on the CPU with ``False``, and the watch then names as on an accelerator)."""
        if self._read_on_host is not None:
            return self._read_on_host
        if place is not None:
            return place.type == "cpu"
        return all(device.type == "cpu" for device in found)

    def zero(self, device: torch.device) -> torch.Tensor:
        """This capture's shared one-element zero flag on ``device``: known to be 0, so
        never read (:attr:`zero_ids`), and never written (nothing writes a flag in place)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros(1, dtype=torch.float32, device=device)
            self.zero_ids.add(id(zero))
        return zero

    def close(self) -> None:
        """Forget the optimizers (the watch registers no hooks on them)."""
        self._registry.close()

    def info(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        """The optimizer's facts (index, fused, DTensor, dtypes), registered on first sight
        and refreshed when a parameter group is added."""
        return self._registry.info(optimizer)

    def close_iteration(
        self,
        identity: Identity,
        origin: Mapping[str, torch.Tensor],
        nonfinite: Mapping[str, int],
        stats: TakenStats | None = None,
        extra: tuple[torch.Tensor, Any] | None = None,
    ) -> PendingStep:
        """End the open iteration: its pending step. On the CPU (host transport) the
        telemetry thread lays it out and reads its flags (host memory; nothing writes them
        any more); on accelerators one small stack and a non-blocking copy here, never a
        sync. ``extra``: values that travel with the step's copy and what names them
        (``PendingStep.extra``, ``PendingStep.fp8``)."""
        iteration = self.iteration
        self.abandon(iteration, self.step + 1)
        pending = PendingStep(identity, self.step, time.time(), False)
        if nonfinite:
            pending.nonfinite = nonfinite
        pending.stats = stats
        if extra is not None:
            pending.extra, pending.fp8 = extra
        on_host = self._read_on_host
        accelerator = None
        if on_host is None:
            accelerator = self._accelerator(iteration, origin)
            on_host = accelerator is None
        if on_host:
            pending.deferred = (self, iteration, origin)
            return pending
        flags = self._name_values(pending, iteration, origin)
        device = torch.device("cpu") if accelerator is None else accelerator
        scale, tracker = self._constants_on(device)
        parts = layout.head(scale, flags) + layout.tail(scale, tracker, origin.values())
        if stats is not None:
            parts += stats.scalars()
        stacked = stack_scalars(parts, device)
        pending.host, pending.ready = copy_with_norms(pending, stacked, stats)
        return pending

    def abandon(self, iteration: Mapping[int, Checked], step: int) -> None:
        """Close ``iteration`` as the ``step``-th without a record (or before making it):
        the step counts, and whether it skipped is kept for ``last_step_skipped``."""
        self.iteration = {}
        self.step = step
        skipped: bool | None = False
        for entry in iteration.values():
            if entry.stepped and skipped is not None:
                skipped = None if entry.skipped is None else skipped or entry.skipped
        self.last_skipped = (
            [e.agreed for e in iteration.values() if e.agreed is not None]
            if skipped is None
            else skipped
        )

    def lay_out(
        self,
        pending: PendingStep,
        iteration: Mapping[int, Checked],
        origin: Mapping[str, torch.Tensor],
    ) -> None:
        """Lay out a host-transport step and read its flags (CPU tensors: host memory).
        Runs on the telemetry thread (:meth:`PendingStep.read`), reading only the
        iteration's own objects and the registry (dict lookups and inserts, atomic under
        the GIL)."""
        flags = self._name_values(pending, iteration, origin)
        zeros = self.zero_ids  # the shared clean flags: known 0, not read
        scale, tracker = layout.WATCH_SCALE, layout.WATCH_TRACKER
        values = layout.head(scale, [0.0 if id(flag) in zeros else flag.item() for flag in flags])
        values += layout.tail(scale, tracker, [flag.item() for flag in origin.values()])
        pending.values = values  # the stats' CPU tensors: read by the records' builder

    def _name_values(
        self,
        pending: PendingStep,
        iteration: Mapping[int, Checked],
        origin: Mapping[str, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Set the step's setup, optimizer slots and device names; return its optimizer
        and local flags, in the order of its values."""
        registry = self._registry
        flags: list[torch.Tensor] = []
        slots = []
        founds = []
        dtypes: frozenset[str] = frozenset()
        for entry in iteration.values():
            info, found = entry.info, entry.found
            own = list(found.values()) if entry.agreed is None else [entry.agreed]
            slots.append(registry.slot(info, entry.stepped, len(own)))
            flags += own
            if info is not None:
                # The common single optimizer keeps its own objects: no merge, no new set.
                dtypes = info.dtypes if not dtypes else dtypes | info.dtypes
            founds.append(found)
        local = max_per_device(founds)
        pending.setup = registry.setup(dtypes)
        pending.optimizers = tuple(slots)
        pending.local_devices = registry.device_names(local)
        pending.origin_devices = tuple(origin)
        flags.extend(local.values())
        return flags

    @staticmethod
    def _accelerator(
        iteration: Mapping[int, Checked], origin: Mapping[str, torch.Tensor]
    ) -> torch.device | None:
        """The first flag's device that is not the CPU. The local flags' devices are
        their keys; only agreed and origin flags are asked (each ask builds a device)."""
        for entry in iteration.values():
            for device in entry.found:
                if device.type != "cpu":
                    return device
            agreed = entry.agreed
            if agreed is not None and agreed.device.type != "cpu":
                return agreed.device
        for flag in origin.values():
            if flag.device.type != "cpu":
                return flag.device
        return None

    # -- constants ---------------------------------------------------------------------

    def _constants_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The watch's scale and tracker as 0-dim float32 tensors on ``device``, made once."""
        constants = self._constants.get(device)
        if constants is None:
            constants = self._constants[device] = (
                torch.full((), layout.WATCH_SCALE, dtype=torch.float32, device=device),
                torch.full((), layout.WATCH_TRACKER, dtype=torch.float32, device=device),
            )
        return constants
