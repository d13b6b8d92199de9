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

Under fp16 the hooks see the gradient multiplied by the loss scale: an inf/NaN there is
one whatever the scale, so the flags need no unscaling.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ampscope.rank import compat


class OwnGradientFlags:
    """One flag per parameter, set when its own (pre-reduction) gradient held inf/NaN.

    Args:
        named: ``(name, parameter)`` pairs; those that do not require grad are skipped.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = [(name, p) for name, p in named if p.requires_grad]
        self._names: dict[torch.device, list[str]] = {}
        for name, param in params:
            self._names.setdefault(param.device, []).append(name)
        self._flags = {
            device: torch.zeros(len(names), dtype=torch.float32, device=device)
            for device, names in self._names.items()
        }
        self._ones = {
            device: torch.ones(1, dtype=torch.float32, device=device) for device in self._flags
        }
        self._lock = threading.Lock()
        self.errors = 0
        """Hook calls that failed (training went on; warned about once)."""
        self._handles: list[Any] = []
        at: dict[torch.device, int] = dict.fromkeys(self._flags, 0)
        for _, param in params:
            device = param.device
            index = at[device]
            at[device] = index + 1
            slot = self._flags[device][index : index + 1]  # a view: the hook writes the vector
            self._handles.append(param.register_hook(self._hook(slot, self._ones[device])))

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the flagged parameters, as records name them."""
        return tuple(str(device) for device in self._flags)

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
            with self._lock:
                self.errors += 1
                first = self.errors == 1
            if first:
                warnings.warn(
                    f"ampscope: could not check a gradient for inf/NaN: {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def take(self) -> tuple[dict[str, bool], dict[str, int]]:
        """The flags since the last call, then zero them: per device whether any of its
        parameters' own gradients held inf/NaN, and the names of those parameters (each
        counted once: the hooks flag a gradient, they do not count its elements).

        Call once per optimizer step, after it (no hook runs concurrently). Costs one
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
        """Remove every hook. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


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
