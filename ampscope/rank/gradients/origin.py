"""Found-inf origin tracking: which rank's own gradients overflowed, before the reduction.

After an all-reduce or reduce-scatter every rank holds the inf/NaN, so the scaler's
post-reduction found-inf cannot say where it came from. Origin tracking checks each
rank's *unreduced* gradients inside the gradient collective itself (a DDP comm hook,
an FSDP comm hook, or an FSDP2 custom reduce-scatter), accumulating the answer into a
device-side flag per device, then runs the collective exactly as torch would have.

This module holds the flags; :mod:`~ampscope.rank.gradients.origin_hooks` the hooks that
mark them. Call order, per iteration::

    handle = install_origin_hooks(model, flags)   # once, before training
    loss.backward()                               # hooks call flags.mark(bucket)
    flags.take()                                  # in the scaler's update(): flags, reset

Cost: per gradient collective, one extra read-only pass over the bucket (``aminmax``,
written into the bucket's slot of a preallocated buffer; with norms a second, its L2
norm), and a few kernels per iteration in :meth:`OriginFlags.take`, whatever the number of
buckets; no host-device sync, and one small buffer per device.
``bench/scaler_distributed.py`` measures it on DDP.
"""

import math
import threading
import warnings

import torch

__all__ = ["OriginFlags"]


class OriginFlags:
    """Per-device found-inf flags that gradient-collective hooks accumulate into.

    One instance per scaler. Hooks call :meth:`mark` on each rank's unreduced gradient
    buckets during backward; the scaler calls :meth:`take` once per iteration.

    Each mark writes its bucket's minimum and maximum (and, with ``norms``, its float32 L2
    norm) into its own slot of a preallocated buffer: one or two kernels per bucket, no
    allocation. :meth:`take` turns a device's slots into its flag and squared norm with a
    few kernels per iteration, whatever the number of buckets. Slots are never shared, and
    buffers never move once handed out, so hooks running concurrently on several autograd
    threads or CUDA streams cannot lose each other's detections.
    """

    def __init__(self, *, norms: bool = False) -> None:
        self._lock = threading.Lock()
        self._norms = norms
        self._extrema: dict[tuple[str, torch.dtype], _Slots] = {}
        """Per device and bucket dtype: each bucket's (min, max), in its own dtype."""
        self._sums: dict[str, _Slots] = {}
        """Per device: each bucket's float32 L2 norm times its factor (``norms=True``)."""
        # Every device ever marked: take() hands out a flag for each of them, so a clean
        # iteration reads as an explicit 0 rather than as a missing device.
        self._devices: dict[str, torch.device] = {}
        self.errors = 0
        """Number of :meth:`mark` calls that failed (the training step went on regardless)."""

    def mark(self, tensor: torch.Tensor, factor: float = 1.0) -> None:
        """Record whether ``tensor`` holds any inf/NaN for ``tensor.device``; with
        ``norms``, also its L2 norm times ``factor`` (``factor`` undoes a division the
        collective's caller already applied), whose square :meth:`take_squares` sums.

        Called from inside gradient-collective hooks, before the collective, on the
        rank's own (unreduced) gradients. Enqueues device work only: one ``aminmax`` (min
        and max are non-finite exactly when some element is: +-inf lands in one of them,
        NaN propagates to both, and unlike a sum they cannot overflow on large finite
        values; one vectorised read-only pass) into the bucket's slot; with ``norms`` a
        float32 L2 norm into another (float32 squares call a finite value above 1.8e19
        non-finite, so the norm cannot stand in for the check), and a multiply where
        ``factor`` is not 1. Never a host-device sync. Safe to call from several threads.
        Never raises: a failure is counted in :attr:`errors` and warned about once,
        because telemetry must not break a training step. Empty, sparse and non-floating
        tensors are ignored; a complex one is checked as its real and imaginary parts.

        Args:
            tensor: A dense gradient bucket or flat gradient, any floating dtype.
        """
        claimed: tuple[torch.Tensor, ...] = ()
        try:
            if tensor.numel() == 0 or tensor.layout != torch.strided:
                return
            if tensor.is_complex():
                tensor = torch.view_as_real(tensor)
            elif not tensor.is_floating_point():
                return
            if tensor.dtype not in _CHECKED:
                # isfinite has no float8 kernels: take() could not read its slot.
                raise TypeError(f"cannot check a {tensor.dtype} bucket")
            device = tensor.device
            key = str(device)
            with self._lock:
                extrema = self._extrema.get((key, tensor.dtype))
                if extrema is None:
                    extrema = self._extrema[(key, tensor.dtype)] = _Slots(device, tensor.dtype, 2)
                    self._devices.setdefault(key, device)
                low, high = claimed = extrema.claim()
                if self._norms:
                    sums = self._sums.get(key)
                    if sums is None:
                        sums = self._sums[key] = _Slots(device, torch.float32, 1)
                    (norm,) = sums.claim()
                    claimed = (low, high, norm)
            with torch.no_grad():
                torch.aminmax(tensor, out=(low, high))
                if self._norms:
                    if tensor.dtype == torch.float64:  # no float32 norm of float64 values
                        norm.copy_(torch.linalg.vector_norm(tensor))
                    else:
                        torch.linalg.vector_norm(tensor, dtype=torch.float32, out=norm)
                    if factor != 1.0:
                        norm.mul_(factor)
        except Exception as exc:  # telemetry must never break a backward pass
            with self._lock:
                # A claimed slot would count stale or empty memory: the check adds no flag
                # (as a failed check never did), the norm is unknown (NaN: no origin norm).
                for slot in claimed[:2]:
                    slot.zero_()
                for slot in claimed[2:]:
                    slot.fill_(math.nan)
                self.errors += 1
                first = self.errors == 1
            if first:
                warnings.warn(
                    f"ampscope origin tracking could not check a gradient bucket: {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def take(self) -> dict[str, torch.Tensor]:
        """This iteration's flags, then start fresh ones.

        Called once per iteration by the scaler (in ``update()``), after backward has
        finished and before the next backward starts. A few kernels per device
        (``isfinite`` over its slots, a reduction); no host sync.

        Returns:
            Device string (``str(tensor.device)``, e.g. ``"cuda:0"``) to a fresh float32
            tensor of shape ``(1,)`` on that device: 1. when that device's unreduced
            gradients held inf/NaN since the previous call, else 0. Every device marked
            at least once so far is present; empty before the first collective ran.
        """
        with self._lock:
            flags = self._flags()
            for slots in self._extrema.values():
                slots.reset()
        return flags

    def peek(self) -> dict[str, torch.Tensor]:
        """This iteration's flags so far, without starting fresh ones (a rerun's read)."""
        with self._lock:
            return self._flags()

    def peek_squares(self) -> dict[str, torch.Tensor]:
        """This iteration's squared norms so far, without starting afresh."""
        with self._lock:
            return self._squares()

    def take_squares(self) -> dict[str, torch.Tensor]:
        """This iteration's squared norms by device (see :meth:`mark`), then start afresh:
        0-dim float32 tensors, fresh. Called by the front-end right after :meth:`take`.
        Empty without ``norms`` or when no collective ran; no sync."""
        with self._lock:
            squares = self._squares()
            for slots in self._sums.values():
                slots.reset()
        return squares

    def _flags(self) -> dict[str, torch.Tensor]:
        bad: dict[str, torch.Tensor] = {}
        for (key, _), slots in self._extrema.items():
            used = slots.used()
            if used is None:
                continue
            hit = torch.isfinite(used).all().logical_not()
            bad[key] = hit if key not in bad else bad[key].logical_or(hit)
        return {
            key: bad[key].float().reshape(1) if key in bad else _zero_flag(device)
            for key, device in self._devices.items()
        }

    def _squares(self) -> dict[str, torch.Tensor]:
        squares = {}
        for key, slots in self._sums.items():
            used = slots.used()
            if used is not None:
                norms = used.reshape(-1)
                squares[key] = torch.dot(norms, norms)
        return squares


_CHECKED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The bucket dtypes :meth:`OriginFlags.mark` checks (complex ones as their real parts)."""

_CHUNK = 64
"""Slots per buffer: more buckets than this in one iteration add a buffer."""


class _Slots:
    """One device's (and dtype's) per-bucket results of an iteration: rows of ``width``
    values in buffers of :data:`_CHUNK` rows, handed out one row per mark and never moved
    (a hook may still be writing a row while another claims the next). Kept across
    iterations; :meth:`reset` starts the rows over. Callers hold the owner's lock."""

    __slots__ = ("_buffers", "_count", "_device", "_dtype", "_rows", "_width")

    def __init__(self, device: torch.device, dtype: torch.dtype, width: int) -> None:
        self._device, self._dtype, self._width = device, dtype, width
        self._buffers: list[torch.Tensor] = []
        self._rows: list[tuple[torch.Tensor, ...]] = []
        """Every row's 0-dim views, made once with its buffer: a claim makes none."""
        self._count = 0

    def claim(self) -> tuple[torch.Tensor, ...]:
        """The next free row, as ``width`` 0-dim views to write into."""
        if self._count == len(self._rows):
            buffer = torch.empty(_CHUNK, self._width, dtype=self._dtype, device=self._device)
            self._buffers.append(buffer)
            self._rows += [tuple(row.unbind()) for row in buffer.unbind()]
        row = self._rows[self._count]
        self._count += 1
        return row

    def used(self) -> torch.Tensor | None:
        """The rows written this iteration (a view, or a concatenation past one buffer);
        ``None`` before any."""
        if not self._count:
            return None
        full, rest = divmod(self._count, _CHUNK)
        parts = self._buffers[:full] + ([self._buffers[full][:rest]] if rest else [])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def reset(self) -> None:
        self._count = 0


def _zero_flag(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)
