"""What one iteration of a :class:`~ampscope.GradWatch` saw, captured at the least cost.

Per optimizer, :func:`check_local` runs torch's fused multi-tensor non-finite kernel
(the one its unscale runs) once per (device, dtype) group of this rank's local gradients
(DTensor shards, under FSDP2 and tensor parallelism) with an inverse scale of 1: one
pass over gradient memory (the kernel writes each value back unchanged), no sync. Its
one-element flags stay on the device. On the CPU with the gradient norms on (``stats``),
the norms, taken first, decide a clean iteration alone
(:meth:`WatchCapture.clean_from_norms`): an inf/NaN element always makes its norm
non-finite, so finite norms spare the kernel; a non-finite norm (which finite elements
above ~1.8e19 also give, in float32) leaves the decision to it.

Under ``skip`` and ``raise``, :func:`agree` max-reduces them into one flag with a single
all-reduce on the watch's process group, so that every rank decides alike. Under
``observe`` nothing more happens until update(), which hands the flags to the telemetry
thread the way the scalers' capture does: on the CPU the telemetry thread lays the
step out and reads them (host memory, no sync; nothing writes them any more), else they
are stacked and copied to pinned memory without blocking.

The values follow the scalers' layout, ``[scale_before, *optimizer flags, *local flags,
scale_after, growth_tracker, *origin flags]``, with a scale of 1 and a tracker of 0, so
one :class:`~ampscope.rank.telemetry.records.RecordBuilder` builds both kinds of record; the
pending step's :class:`~ampscope.reporter.schema.Setup` tells it which kind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ampscope.rank import compat
from ampscope.rank.capture.scaler import (
    FoundInf,
    OptimizerInfo,
    OptimizerSlot,
    PendingStep,
    copy_with_norms,
    grad_dtype,
    stack_scalars,
)
from ampscope.rank.telemetry.identity import collective_device
from ampscope.reporter.schema import Identity, Policy, Setup

if TYPE_CHECKING:
    from ampscope.rank.gradients.stats import TakenStats

_READ_EACH = 8
"""Up to this many norms, reading each costs less than stacking them first."""

_NO_FLAGS: Mapping[torch.device, torch.Tensor] = MappingProxyType({})


def _merged(
    a: Mapping[torch.device, torch.Tensor], b: FoundInf
) -> dict[torch.device, torch.Tensor]:
    """Per device, the max of two optimizers' local flags (one small op per shared device)."""
    out = dict(a)
    for device, flag in b.items():
        mine = out.get(device)
        out[device] = flag if mine is None else torch.maximum(mine, flag)
    return out


class Checked:
    """One optimizer's check in the open iteration (training thread only)."""

    __slots__ = ("agreed", "found", "info", "nonfinite", "skipped", "stepped")

    def __init__(self, info: OptimizerInfo, found: FoundInf, agreed: torch.Tensor | None) -> None:
        self.info = info
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


def check_local(
    optimizer: torch.optim.Optimizer,
    info: OptimizerInfo,
    ones: dict[torch.device, torch.Tensor],
) -> dict[torch.device, torch.Tensor]:
    """This rank's found-inf per device for ``optimizer``'s local gradients.

    Groups the gradients by device and dtype as torch's unscale does (sparse ones by their
    stored values, DTensors by their local shards) and runs the fused kernel once per
    group, into one zeroed flag per device. ``ones`` caches the inverse scale of 1 per
    device. Cost: one Python walk over the parameters, one small fill per device, one
    kernel per group; no sync.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    place = info.place
    if place is not None:
        # One device and dtype, known from the parameters: one group, unless sparse.
        dense = [g for g in grads if g is not None]
        if not any(g.is_sparse for g in dense):
            device = place[0]
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            if dense:
                _check_group(dense, flag, _one_on(device, ones))
            return {device: flag}
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for grad in grads:
        if grad is None:
            continue
        local = compat.local_tensor(grad) if info.dtensor else grad
        if local.is_sparse:
            local = compat.sparse_values(local)
        per_dtype = groups.get(local.device)
        if per_dtype is None:
            per_dtype = groups[local.device] = {}
        same = per_dtype.get(local.dtype)
        if same is None:
            per_dtype[local.dtype] = [local]
        else:
            same.append(local)
    found: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for same in per_dtype.values():
            _check_group(same, flag, _one_on(device, ones))
        found[device] = flag
    return found


def _one_on(device: torch.device, ones: dict[torch.device, torch.Tensor]) -> torch.Tensor:
    one = ones.get(device)
    if one is None:
        one = ones[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def _check_group(grads: list[torch.Tensor], flag: torch.Tensor, one: torch.Tensor) -> None:
    # Gradients that require grad themselves (create_graph=True) must not record the
    # kernel; entering no_grad costs more than the kernel, so only for those.
    if torch.is_grad_enabled() and any(g.requires_grad for g in grads):
        with torch.no_grad():
            compat.non_finite_check_(grads, flag, one)
    else:
        compat.non_finite_check_(grads, flag, one)


def agree(found: FoundInf, group: dist.ProcessGroup | None) -> torch.Tensor:
    """One flag, 1 when any rank of ``group`` found inf/NaN: the local flags' max, then one
    all-reduce (max) of that one-element tensor when the process group has several ranks.
    A rank with no gradients still takes part, with a zero flag. The local flags stay
    unchanged (the all-reduce works on a copy)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    flags = list(found.values())
    if not flags:
        device = collective_device(group) if distributed else torch.device("cpu")
        flag = torch.zeros(1, dtype=torch.float32, device=device)
    elif len(flags) == 1:
        flag = flags[0].clone() if distributed else flags[0]
    else:
        flag = flags[0].clone()
        for other in flags[1:]:
            torch.maximum(flag, other.to(flag.device), out=flag)
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
        self._optimizers: dict[int, OptimizerInfo] = {}
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
        self._slots: dict[tuple[int, str, bool, bool, int], OptimizerSlot] = {}
        self._device_names: dict[tuple[torch.device, ...], tuple[str, ...]] = {}
        self._setups: dict[frozenset[str], Setup] = {}

    def clean_from_norms(
        self, norms: tuple[torch.Tensor, ...], device: torch.device
    ) -> dict[torch.device, torch.Tensor] | None:
        """The found-inf of gradients on the CPU whose norms (one per gradient, every
        element counted) were just taken, without the non-finite kernel: when every norm is
        finite no element is inf/NaN (one would make its norm inf or NaN), and the flag is
        this capture's zero on ``device``. ``None`` when some norm is not finite: that may
        come from finite elements too (a float32 square overflows above ~1.8e19), so the
        kernel must decide. Reads the norms on the host: only for CPU tensors (no sync),
        and never when the capture is told to use the device transport (which stands for
        an accelerator in tests): then ``None``.

        The zero flag is shared by every clean iteration: nothing writes a flag in place
        (:func:`agree` reduces a copy; records read them).
        """
        if self._read_on_host is False:
            return None
        if len(norms) <= _READ_EACH:
            total = sum([norm.item() for norm in norms])
        else:
            total = sum(torch.stack(norms).tolist())
        # float64 sums of float32 norms do not overflow; wider norms may (then: the kernel).
        if not math.isfinite(total):
            return None
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros(1, dtype=torch.float32, device=device)
            self.zero_ids.add(id(zero))
        return {device: zero}

    def close(self) -> None:
        """Nothing to undo: the watch registers no hooks on optimizers."""
        self._optimizers.clear()

    def info(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        """The optimizer's facts (index, fused, DTensor, dtypes), registered on first sight
        and refreshed when a parameter group is added."""
        key = id(optimizer)
        info = self._optimizers.get(key)
        if info is None or info.ref() is not optimizer:
            info = self._optimizers[key] = OptimizerInfo(
                optimizer, len(self._optimizers), count_steps=False
            )
        if len(optimizer.param_groups) != info.groups:
            info.refresh(optimizer)
        return info

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
        iteration, self.iteration = self.iteration, {}
        self.step += 1
        skipped: bool | None = False
        for entry in iteration.values():
            if entry.stepped and skipped is not None:
                skipped = None if entry.skipped is None else skipped or entry.skipped
        self.last_skipped = (
            [e.agreed for e in iteration.values() if e.agreed is not None]
            if skipped is None
            else skipped
        )
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
            pending.fill = (self, iteration, origin)
            return pending
        flags = self._lay_out(pending, iteration, origin)
        device = torch.device("cpu") if accelerator is None else accelerator
        one, zero = self._constants_on(device)
        scalars = stats.scalars() if stats is not None else []
        stacked = stack_scalars([one, *flags, one, zero, *origin.values(), *scalars], device)
        pending.host, pending.ready = copy_with_norms(pending, stacked, stats)
        return pending

    def fill(
        self,
        pending: PendingStep,
        iteration: Mapping[int, Checked],
        origin: Mapping[str, torch.Tensor],
    ) -> None:
        """Lay out a host-transport step and read its flags (CPU tensors: host memory).
        Runs on the telemetry thread (:meth:`PendingStep.read`), reading only the
        iteration's own objects and this capture's caches (dict lookups and inserts,
        atomic under the GIL)."""
        flags = self._lay_out(pending, iteration, origin)
        zeros = self.zero_ids  # the shared clean flags: known 0, not read
        values = [1.0]
        values += [0.0 if id(flag) in zeros else flag.item() for flag in flags]
        values += (1.0, 0.0)
        values += [flag.item() for flag in origin.values()]
        pending.values = values  # the stats' CPU tensors: read by the records' builder

    def _lay_out(
        self,
        pending: PendingStep,
        iteration: Mapping[int, Checked],
        origin: Mapping[str, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Set the step's setup, optimizer slots and device names; return its optimizer
        and local flags, in the order of its values."""
        opt_flags: list[torch.Tensor] = []
        slots: list[OptimizerSlot] = []
        local: Mapping[torch.device, torch.Tensor] = _NO_FLAGS
        dtypes: frozenset[str] = frozenset()
        for entry in iteration.values():
            info, found = entry.info, entry.found
            flags = list(found.values()) if entry.agreed is None else [entry.agreed]
            slots.append(self._slot(info, entry.stepped, len(flags)))
            opt_flags += flags
            # The common single optimizer keeps its own objects: no merge, no new set.
            dtypes = info.dtypes if not dtypes else dtypes | info.dtypes
            local = found if not local else _merged(local, found)
        pending.setup = self._setup(dtypes)
        pending.optimizers = tuple(slots)
        pending.local_devices = self._device_names_of(local)
        pending.origin_devices = tuple(origin)
        return opt_flags + list(local.values())

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

    # -- shared immutable parts ----------------------------------------------------------

    def _slot(self, info: OptimizerInfo, stepped: bool, num_flags: int) -> OptimizerSlot:
        key = (info.index, info.name, info.fused, stepped, num_flags)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = OptimizerSlot(
                index=info.index,
                name=info.name,
                fused=info.fused,
                stepped=stepped,
                num_flags=num_flags,
            )
        return slot

    def _device_names_of(self, local: Mapping[torch.device, torch.Tensor]) -> tuple[str, ...]:
        """The devices' names, one shared tuple per combination."""
        devices = tuple(local)
        names = self._device_names.get(devices)
        if names is None:
            names = self._device_names[devices] = tuple(str(d) for d in devices)
        return names

    def _setup(self, dtypes: frozenset[str]) -> Setup:
        setup = self._setups.get(dtypes)
        if setup is None:
            setup = self._setups[dtypes] = Setup(
                mode="watch", policy=self.policy, grad_dtype=grad_dtype(dtypes)
            )
        return setup

    def _constants_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A scale of 1 and a tracker of 0 as 0-dim float32 tensors on ``device``, made once."""
        constants = self._constants.get(device)
        if constants is None:
            constants = self._constants[device] = (
                torch.ones((), dtype=torch.float32, device=device),
                torch.zeros((), dtype=torch.float32, device=device),
            )
        return constants
