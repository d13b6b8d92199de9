"""Which of this rank's own parameters' gradients held inf/NaN before DeepSpeed reduced them.

DeepSpeed reduces (ZeRO 1/2: reduce-scatters or all-reduces, ZeRO-3: reduce-scatters)
each gradient in hooks that run after autograd accumulated it; a tensor hook
(``param.register_hook``) runs before those, on the gradient this rank's backward just
computed, whatever the stage. :class:`OwnGradientFlags` registers one such hook per
parameter. Each hook runs torch's fused non-finite kernel (the one a scaler's unscale
runs, with an inverse scale of 1: the values are written back unchanged) on that one
gradient, into the parameter's own slot of one float32 flag vector per device (where a
build lacks that kernel for a dtype, CUDA bfloat16 in torch 2.11, the shared check's
read-only norm fallback, ``compat.non_finite_check_``; a read-only ``aminmax`` for a
non-contiguous gradient): one kernel per parameter and micro-batch, no
allocation, no host-device sync, no name looked up. Slots only go from 0 to 1, so
micro-batches combine (ZeRO-2 frees each micro-batch's gradient after reducing it; ZeRO-1
accumulates) and autograd threads cannot lose each other's marks.
:meth:`OwnGradientFlags.take` reads the vectors once per optimizer step and names the
flagged parameters only then.

Where DeepSpeed leaves the gradients in ``.grad`` until one reduction at the accumulation
boundary (ZeRO-0, ZeRO-1; which engines do is read in
:func:`~ampscope.integrations._deepspeed_engine.reduces_at_boundary_only`),
:class:`BoundaryGradientFlags` replaces the hooks: nothing runs per parameter during
backward, and one check right before that reduction reads every gradient once, summed over
the step's micro-batches (an inf/NaN stays one in a sum; an fp16 sum of finite gradients
that overflows is an inf in this rank's own gradient before the reduction, flagged as the
reduction would carry it).

Under fp16 both see the gradient multiplied by the loss scale: an inf/NaN there is one
whatever the scale, so the flags need no unscaling.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ampscope.rank import compat


class _FlagVectors:
    """One float32 flag per parameter that requires grad, one vector per device: slots only
    go from 0 to 1 between two :meth:`take` calls, so micro-batches combine and concurrent
    autograd threads cannot lose each other's marks."""

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

    def take(self) -> tuple[dict[str, bool], dict[str, int]]:
        """The flags since the last call, then zero them: per device whether any of its
        parameters' own gradients held inf/NaN, and the names of those parameters (each
        counted once: a gradient is flagged, its elements are not counted).

        Call once per optimizer step, after it (no check runs concurrently). Costs one
        reduction and one host read per device (a sync on an accelerator); the names are
        looked up only on a device whose flags are set.
        """
        by_device: dict[str, bool] = {}
        named: dict[str, int] = {}
        for device, flags in self._flags.items():
            hit = bool(flags.any())  # one reduction and one read; names only when set
            if hit:
                for name, value in zip(self._names[device], flags.tolist(), strict=True):
                    if value > 0:
                        named[name] = 1
                flags.zero_()
            by_device[str(device)] = hit
        return by_device, named

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

    :meth:`check` reads each device's gradients once (``compat.non_finite_each``: torch's
    multi-tensor L1 norm per gradient, accumulated in float64, so a gradient is flagged
    exactly when it holds inf/NaN, as the hooks' kernel flags it; a sum carries inf and NaN
    on every device, unlike a max), then one small op into the flag vector. No sync, the
    gradients only read. Its Python is one list of the gradients per optimizer step, none
    per micro-batch.

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
        boundary's reduction; runs once per optimizer step (later calls until :meth:`take`
        return at once). Never raises."""
        if self._checked:
            return
        self._checked = True
        try:
            with torch.no_grad():
                for flags, params, absent in self._groups:
                    grads = [absent if (g := p.grad) is None else g for p in params]
                    flags.masked_fill_(compat.non_finite_each(grads), 1.0)
        except Exception as exc:  # telemetry must never break a backward pass
            self._failed(exc)

    def check_now(self) -> None:
        """Right before ``step()`` at a boundary: the check, if the reduction did not run it
        (a boundary micro-batch in ``no_sync()``, unmanaged accumulation)."""
        self.check()

    def take(self) -> tuple[dict[str, bool], dict[str, int]]:
        taken = super().take()
        self._checked = False
        return taken

    take.__doc__ = _FlagVectors.take.__doc__


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
