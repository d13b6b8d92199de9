"""What a capture knows across iterations: its optimizers and the parts its steps share.

Both captures (a scaler's :class:`~ampscope.rank.capture.scaler.StepCapture`, a watch's
:class:`~ampscope.rank.capture.watch.WatchCapture`) keep one :class:`CaptureRegistry`:
an :class:`OptimizerInfo` per optimizer, registered on first sight and refreshed only
when a parameter group is added, and the immutable parts of their pending steps (optimizer
slots, device names, setups), made once per distinct value and shared by every step that
has it, so that the records' builder can share its own parts in turn.

The training thread registers optimizers; the telemetry thread may read the optimizers and
fill the caches while it lays a step out (dict lookups and inserts, atomic under the GIL).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ampscope.rank import compat
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.reporter.schema import OriginGroup, Policy, RankMode, Setup


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


SlotKey = tuple[int, str, bool, bool, int]
"""An optimizer slot's fields: index, name, fused, stepped, number of flags."""


class CaptureRegistry:
    """One capture's optimizers and the immutable parts its pending steps share.

    Args:
        mode: What the front-end is (named in every setup): ``"scaler"`` or ``"watch"``.
        policy: What it does with a non-finite iteration (a scaler skips it).
        count_steps: Count each optimizer's ``step()`` calls with a public step pre-hook
            (a scaler: torch steps an optimizer only when its found-inf is zero).
    """

    def __init__(self, *, mode: RankMode, policy: Policy, count_steps: bool) -> None:
        self._mode = mode
        self._policy = policy
        self._count_steps = count_steps
        self._optimizers: dict[int, OptimizerInfo] = {}
        self._slots: dict[SlotKey, OptimizerSlot] = {}
        self._device_names: dict[tuple[torch.device, ...], tuple[str, ...]] = {}
        self._setups: dict[frozenset[str], Setup] = {}
        self._origin_group: OriginGroup | None = None

    def info(self, optimizer: torch.optim.Optimizer) -> OptimizerInfo:
        """The optimizer's facts (index, fused, DTensor, dtypes, place), registered on first
        sight (with its step pre-hook when counting) and refreshed when a parameter group
        is added. Training thread."""
        key = id(optimizer)
        info = self._optimizers.get(key)
        if info is None or info.ref() is not optimizer:
            # A reused id of a collected optimizer gets a fresh entry and index.
            info = self._optimizers[key] = OptimizerInfo(
                optimizer, len(self._optimizers), count_steps=self._count_steps
            )
        if len(optimizer.param_groups) != info.groups:
            info.refresh(optimizer)
        return info

    def known(self, key: int) -> OptimizerInfo | None:
        """The optimizer registered under ``id()`` ``key``, if any."""
        return self._optimizers.get(key)

    def close(self) -> None:
        """Remove the step pre-hooks from every optimizer still alive; forget them all."""
        for info in self._optimizers.values():
            if info.handle is not None:
                info.handle.remove()
        self._optimizers.clear()

    # -- shared immutable parts ----------------------------------------------------------

    def slot(self, info: OptimizerInfo | None, stepped: bool, num_flags: int) -> OptimizerSlot:
        """The optimizer's slot in a step; an optimizer never registered is ``unknown``."""
        if info is None:
            key: SlotKey = (0, "unknown", False, stepped, num_flags)
        else:
            key = (info.index, info.name, info.fused, stepped, num_flags)
        slot = self._slots.get(key)
        if slot is None:
            index, name, fused, was_stepped, flags = key
            slot = self._slots[key] = OptimizerSlot(
                index=index, name=name, fused=fused, stepped=was_stepped, num_flags=flags
            )
        return slot

    def device_names(self, devices: Mapping[torch.device, Any]) -> tuple[str, ...]:
        """The names of ``devices`` (its keys, in order), one shared tuple per combination."""
        key = tuple(devices)
        names = self._device_names.get(key)
        if names is None:
            names = self._device_names[key] = tuple(str(d) for d in key)
        return names

    def set_origin_group(self, group: OriginGroup | None) -> None:
        """Name ``group`` in every later step's setup (origin tracking attached)."""
        if group != self._origin_group:
            self._origin_group = group
            self._setups.clear()

    def setup(self, dtypes: frozenset[str]) -> Setup:
        """The setup of a step whose gradients have ``dtypes``; one per combination."""
        setup = self._setups.get(dtypes)
        if setup is None:
            setup = self._setups[dtypes] = Setup(
                mode=self._mode,
                policy=self._policy,
                grad_dtype=grad_dtype(dtypes),
                origin_group=self._origin_group,
            )
        return setup
