"""Which of this rank's own parameters' gradients held inf/NaN before DeepSpeed reduced them.

Three ways to the same flags (one float32 flag per parameter, one vector per device,
slots only going from 0 to 1 until :meth:`~_FlagVectors.take_on_device` copies them
once per optimizer step, on the device, and :meth:`~_FlagVectors.name` names the flagged
parameters from the copy's host values, on the telemetry thread), each checking the
gradients right before DeepSpeed reduces them;
:mod:`~ampscope.integrations.deepspeed.reduction` says where that is for an engine:

* :class:`BoundaryGradientFlags` (ZeRO-0, ZeRO-1): DeepSpeed leaves the gradients in
  ``.grad`` until one reduction at the accumulation boundary; one check of all of them
  right before it, summed over the step's micro-batches (an inf/NaN stays one in a sum; an
  fp16 sum of finite gradients that overflows is an inf in this rank's own gradient before
  the reduction, which the reduction would carry). Nothing per micro-batch.
* :class:`BucketGradientFlags` (ZeRO-2 and ZeRO-3): DeepSpeed reduces bucket by bucket
  during every backward, each bucket holding this micro-batch's own gradients; one check
  per bucket right before its reduction. Nothing per parameter.
* :class:`OwnGradientFlags` (every path the first two do not fit: ZeRO-2/3 offload,
  ZenFlow, ...): a tensor hook (``param.register_hook``) per parameter, which runs before
  DeepSpeed's own reduce hooks on the gradient this rank's backward just computed,
  whatever the stage. Each hook runs torch's fused non-finite kernel (the one a scaler's
  unscale runs, with an inverse scale of 1: every value is written back as it was, but a
  NaN of an fp16/bf16 gradient may come back as a NaN of another bit pattern) on that one
  gradient, into the parameter's slot (where a build lacks that kernel for a dtype, CUDA
  bfloat16 in torch 2.11, the shared check's read-only norm fallback,
  ``compat.non_finite_check_``; a read-only ``aminmax`` for a non-contiguous gradient):
  one kernel and one Python call per parameter and micro-batch, no allocation, no sync.

The first two read the gradients with ``compat.non_finite_each`` (torch's multi-tensor L1
norm per gradient, accumulated in float64: exact, a gradient is flagged when and only when
it holds inf/NaN, as the hooks' kernel flags it) and never write them; on the CPU, where
those norms take torch's per-tensor fallback, the hooks' fused kernel checks the whole list
first (with its caveat: a NaN there may change bit pattern, inf/NaN stays inf/NaN, every
other value is unchanged) and the norms run only when it found something. None of them syncs with an
accelerator: the monitor reads the flags' copies on its telemetry thread. Under fp16 all
of them see the gradients multiplied by the loss scale: an inf/NaN there is one whatever
the scale, so the flags need no unscaling.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ampscope.rank import compat


class _FlagVectors:
    """One float32 flag per parameter that requires grad, one vector per device: slots only
    go from 0 to 1 between two :meth:`take_on_device` calls, so micro-batches combine and
    concurrent autograd threads cannot lose each other's marks."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._params: dict[torch.device, list[torch.Tensor]] = {}
        self._names: dict[torch.device, list[str]] = {}
        for name, param in named:
            if param.requires_grad:
                self._params.setdefault(param.device, []).append(param)
                self._names.setdefault(param.device, []).append(name)
        self._flags = {
            device: torch.zeros(len(names), dtype=torch.float32, device=device)
            for device, names in self._names.items()
        }
        self._labels = {str(device): names for device, names in self._names.items()}
        self._lock = threading.Lock()
        self.errors = 0
        """Checks that failed (training went on; warned about once)."""

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the flagged parameters, as records name them."""
        return tuple(str(device) for device in self._flags)

    def check_now(self) -> None:
        """Right before ``step()`` at a boundary: check the gradients if this step's check
        has not run yet (see :class:`BoundaryGradientFlags`); the hooks have checked."""

    def take_on_device(self) -> dict[str, torch.Tensor]:
        """The flags since the last call, by device (as records name it): a copy of each
        device's vector, on that device, then zero them. No sync: one small copy and one
        fill per device, queued after the checks. Call once per optimizer step, after it
        (no check runs concurrently); :meth:`name` reads the copies' host values."""
        taken: dict[str, torch.Tensor] = {}
        for device, flags in self._flags.items():
            taken[str(device)] = flags.clone()
            flags.zero_()
        return taken

    def name(self, host: Mapping[str, Sequence[float]]) -> tuple[dict[str, bool], dict[str, int]]:
        """From the host values of :meth:`take_on_device`'s copies: per device whether any
        of its parameters' own gradients held inf/NaN, and the names of those parameters
        (each counted once: a gradient is flagged, its elements are not counted). Host
        work only (the telemetry thread); names are looked up only on a flagged device."""
        by_device: dict[str, bool] = {}
        named: dict[str, int] = {}
        for device, values in host.items():
            hit = any(value > 0 for value in values)
            if hit:
                for name, value in zip(self._labels[device], values, strict=True):
                    if value > 0:
                        named[name] = 1
            by_device[device] = hit
        return by_device, named

    def take(self) -> tuple[dict[str, bool], dict[str, int]]:
        """:meth:`take_on_device` then :meth:`name`, read at once: one host read per
        device (a sync on an accelerator; the monitor leaves the read to its telemetry
        thread instead)."""
        taken = self.take_on_device()
        return self.name({device: flags.tolist() for device, flags in taken.items()})

    def remove(self) -> None:
        """Stop checking. Idempotent."""

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self.errors += 1
            first = self.errors == 1
        if first:
            warnings.warn(
                f"ampscope: could not check a gradient for inf/NaN: {exc!r}",
                RuntimeWarning,
                stacklevel=3,
            )


class OwnGradientFlags(_FlagVectors):
    """One flag per parameter, set by a tensor hook when its own (pre-reduction) gradient
    held inf/NaN: one kernel and one Python call per parameter and micro-batch, at any
    ZeRO stage (ZeRO-2/3 reduce during backward, right after these hooks).

    Args:
        named: ``(name, parameter)`` pairs; those that do not require grad are skipped.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__(named)
        self._handles: list[Any] = []
        for device, params in self._params.items():
            one = torch.ones(1, dtype=torch.float32, device=device)
            for index, param in enumerate(params):
                slot = self._flags[device][index : index + 1]  # a view: the hook writes the vector
                self._handles.append(param.register_hook(self._hook(slot, one)))

    def _hook(self, slot: torch.Tensor, one: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._mark(grad, slot, one)

        return hook

    def _mark(self, grad: torch.Tensor, slot: torch.Tensor, one: torch.Tensor) -> None:
        try:
            if grad.layout != torch.strided or not grad.is_floating_point() or not grad.numel():
                return
            # No no_grad: it would cost as much as the kernel, once per parameter and
            # micro-batch, and the check records nothing (the fused kernel has no
            # derivative, and backward(create_graph=True) keeps its graph: a test says so).
            _check(grad, slot, one)
        except Exception as exc:  # telemetry must never break a backward pass
            self._failed(exc)

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BoundaryGradientFlags(_FlagVectors):
    """The same flags from one check of every ``.grad`` right before the boundary's
    reduction (where DeepSpeed reduces only there): nothing per parameter during backward.

    :meth:`check` reads each (device, dtype) group of gradients once (:func:`_non_finite_each`:
    torch's multi-tensor L1 norm per gradient, accumulated in float64, so a gradient is
    flagged exactly when it holds inf/NaN, as the hooks' kernel flags it; a sum carries inf
    and NaN on every device, unlike a max), then one small op into the flag vector. No sync
    on an accelerator. Its Python is one list of the gradients per optimizer step, none per
    micro-batch.

    Args:
        named: ``(name, parameter)`` pairs; those that do not require grad are skipped.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Sorted by dtype (stably): each (device, dtype) group is one contiguous slice of its
        # device's flag vector and one list of one dtype, which torch's multi-tensor kernels
        # take in their fast route on an accelerator (a mixed list falls back per tensor).
        super().__init__(sorted(named, key=lambda item: str(item[1].dtype)))
        self._checked = False
        self._groups: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]] = []
        for device, params in self._params.items():
            start = 0
            for dtype, run in itertools.groupby(params, key=lambda param: param.dtype):
                members = list(run)
                end = start + len(members)
                # Stands in for a parameter without a gradient (unused this step): clean.
                absent = torch.zeros(1, dtype=dtype, device=device)
                self._groups.append((self._flags[device][start:end], members, absent))
                start = end

    def check(self) -> None:
        """Flag the parameters whose gradient holds inf/NaN now. Call right before the
        boundary's reduction; runs once per optimizer step (later calls until
        :meth:`take_on_device` return at once). Never raises."""
        if self._checked:
            return
        self._checked = True
        try:
            with torch.no_grad():
                for flags, params, absent in self._groups:
                    grads = [absent if (g := p.grad) is None else g for p in params]
                    bad = _non_finite_each(grads)
                    if bad is not None:
                        flags.masked_fill_(bad, 1.0)
        except Exception as exc:  # telemetry must never break a backward pass
            self._failed(exc)

    def check_now(self) -> None:
        """Right before ``step()`` at a boundary: the check, if the reduction did not run it
        (a boundary micro-batch in ``no_sync()``, unmanaged accumulation)."""
        self.check()

    def take_on_device(self) -> dict[str, torch.Tensor]:
        taken = super().take_on_device()
        self._checked = False
        return taken

    take_on_device.__doc__ = _FlagVectors.take_on_device.__doc__


_Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A bucket layout: its device's flag vector, its parameters' slots, the positions kept."""


class BucketGradientFlags(_FlagVectors):
    """The same flags from one check per gradient bucket, right before DeepSpeed reduces
    it (ZeRO-2: :func:`~ampscope.integrations.deepspeed.reduction.check_each_bucket`; ZeRO-3:
    :func:`~ampscope.integrations.deepspeed.reduction.check_each_partition_bucket`), on the
    bucket's own gradients of this micro-batch: nothing runs per parameter.

    :meth:`check` reads the bucket's gradients once (:func:`_non_finite_each`, exact, as
    for :class:`BoundaryGradientFlags`) and adds the result into the flag vector at the
    bucket's parameters' slots (``index_add_``: no sync). The slots of a bucket's
    parameters, an index tensor on the device, are built the first time that bucket's
    layout is seen and reused (DeepSpeed fills its buckets in the same order every
    micro-batch); building one is a host-to-device copy.

    Args:
        named: ``(name, parameter)`` pairs; those that do not require grad are skipped.
        param_id: DeepSpeed's id of a parameter, as its buckets name them.
    """

    _LAYOUTS = 256
    """Bucket layouts kept (a model whose backward order changes starts over past it)."""

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        param_id: Callable[[torch.Tensor], int],
    ) -> None:
        super().__init__(named)
        self._slots: dict[int, tuple[torch.device, int]] = {}
        for device, params in self._params.items():
            for index, param in enumerate(params):
                self._slots[param_id(param)] = (device, index)
        self._layouts: dict[tuple[int, ...], _Layout | None] = {}

    def check(self, grads: list[torch.Tensor], ids: tuple[int, ...]) -> None:
        """Flag the bucket's parameters whose gradient holds inf/NaN: ``grads`` and DeepSpeed's
        ``ids`` of their parameters, in the same order. Never raises."""
        try:
            layout = self._layouts[ids] if ids in self._layouts else self._layout(ids)
            if layout is None:
                return  # none of the module's parameters
            flags, index, known = layout
            with torch.no_grad():
                bad = _non_finite_each(grads)
                if bad is None:
                    return
                if known is not None:
                    bad = bad.index_select(0, known)
                flags.index_add_(0, index, bad.to(flags.dtype))
        except Exception as exc:  # telemetry must never break a backward pass
            self._failed(exc)

    def _layout(self, ids: tuple[int, ...]) -> _Layout | None:
        """The flag vector, the slots of the bucket's parameters in it and, when some of
        them are not the module's (an optimizer given other parameters too), the positions
        in the bucket of those that are; ``None`` when none is."""
        if len(self._layouts) >= self._LAYOUTS:
            self._layouts.clear()
        positions = [k for k, i in enumerate(ids) if i in self._slots]
        slots = [self._slots[ids[k]] for k in positions]
        if not slots:
            self._layouts[ids] = None
            return None
        device = slots[0][0]
        if any(slot[0] != device for slot in slots):
            raise ValueError("a gradient bucket spans devices")
        index = torch.tensor([slot[1] for slot in slots], dtype=torch.long, device=device)
        known = None
        if len(positions) < len(ids):
            known = torch.tensor(positions, dtype=torch.long, device=device)
        layout = self._layouts[ids] = (self._flags[device], index, known)
        return layout


def _non_finite_each(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Whether each of ``grads`` (one device) holds inf/NaN, as a bool vector on their device
    (``compat.non_finite_each``: read only, no sync); ``None`` when it is known without a
    sync that none does.

    On the CPU a value is read for free, and torch's fused non-finite kernel (the hooks'
    kernel, which writes each value back as it was, a NaN's bit pattern aside in fp16/bf16:
    ``compat.non_finite_check_``) checks a whole list for a tenth of the
    per-gradient norms' cost (those take torch's per-tensor fallback there): it runs first
    and the norms only when it found something. Accelerators take the norms' multi-tensor
    kernels directly."""
    if grads and grads[0].device.type == "cpu":
        try:
            found = torch.zeros(1, dtype=torch.float32)
            compat.non_finite_check_(grads, found, torch.ones(1, dtype=torch.float32))
            if not found.item():  # on the CPU: no sync to wait for
                return None
        except Exception:  # a list the fused kernel refuses (mixed dtypes): the norms
            pass
    return compat.non_finite_each(grads)


def _check(grad: torch.Tensor, slot: torch.Tensor, one: torch.Tensor) -> None:
    """Set ``slot`` to 1 when ``grad`` holds inf/NaN."""
    if grad.device == slot.device and grad.is_contiguous():
        # The shared check; it falls back by itself where torch lacks the fused kernel for
        # a dtype (CUDA bfloat16).
        compat.non_finite_check_([grad], slot, one)
        return
    # Not contiguous (an expanded gradient cannot be written back): read only, min and max
    # (non-finite exactly when an element is).
    low, high = torch.aminmax(grad)
    finite = torch.isfinite(low).logical_and_(torch.isfinite(high))
    slot.masked_fill_(finite.logical_not_().to(slot.device), 1.0)
