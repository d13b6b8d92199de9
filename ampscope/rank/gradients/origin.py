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

Cost: per gradient collective, one extra read-only pass over the bucket (``aminmax``)
plus a few one-element kernels; no host-device sync and no extra memory beyond two
scalars. ``bench/scaler_distributed.py`` measures it on DDP.
"""

import threading
import warnings

import torch

__all__ = ["OriginFlags"]


class OriginFlags:
    """Per-device found-inf flags that gradient-collective hooks accumulate into.

    One instance per scaler. Hooks call :meth:`mark` on each rank's unreduced gradient
    buckets during backward; the scaler calls :meth:`take` once per iteration.

    Flags only ever go from 0 to 1 within an iteration (a masked fill of the constant 1),
    so hooks running concurrently on several autograd threads or CUDA streams cannot
    lose each other's detections.
    """

    def __init__(self, *, norms: bool = False) -> None:
        self._lock = threading.Lock()
        self._flags: dict[str, torch.Tensor] = {}
        self._norms = norms
        self._squares: dict[str, torch.Tensor] = {}
        """Per device: the sum of the squared L2 norms of the rank's own gradient buckets
        this iteration (``norms=True``), in the units the hooks saw, times their factor."""
        # Every device ever marked: take() hands out a flag for each of them, so a clean
        # iteration reads as an explicit 0 rather than as a missing device.
        self._devices: dict[str, torch.device] = {}
        self.errors = 0
        """Number of :meth:`mark` calls that failed (the training step went on regardless)."""

    def mark(self, tensor: torch.Tensor, factor: float = 1.0) -> None:
        """Record whether ``tensor`` holds any inf/NaN into the flag of ``tensor.device``;
        with ``norms``, also add its squared L2 norm times ``factor**2`` to the device's
        sum (``factor`` undoes a division the collective's caller already applied).

        Called from inside gradient-collective hooks, before the collective, on the
        rank's own (unreduced) gradients. Enqueues device work only: an inf-norm of
        ``tensor`` (one read of it), ``isfinite``, ``logical_not`` and a masked fill of
        the flag; with ``norms`` a second read (a float32 L2 norm: float32 squares would
        call a finite value above 1.8e19 non-finite, so the norm cannot stand in for the
        ``aminmax``) and one accumulate, except for float16 buckets, whose squares cannot
        overflow: there the norm is the check, one read. Never a host-device sync. Safe to call from
        several threads (autograd runs one thread per device, so the sums of one device
        are never added to concurrently). Never
        raises: a failure is counted in :attr:`errors` and warned about once, because
        telemetry must not break a training step. Empty, sparse and non-floating
        tensors are ignored.

        Args:
            tensor: A dense gradient bucket or flat gradient, any floating dtype.
        """
        try:
            if tensor.numel() == 0 or tensor.layout != torch.strided:
                return
            if not (tensor.is_floating_point() or tensor.is_complex()):
                return
            key = str(tensor.device)
            flag = self._flags.get(key)
            if flag is None:
                flag = self._flag_for(key, tensor.device)
            with torch.no_grad():
                if self._norms and tensor.dtype == torch.float16:
                    # The squares of float16 values (at most 65504^2) cannot overflow a
                    # float32 sum, so the norm is non-finite exactly when an element is:
                    # one read gives the check and the norm.
                    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
                    flag.masked_fill_(torch.isfinite(norm).logical_not_(), 1.0)
                else:
                    # min and max are non-finite exactly when some element is: +-inf lands
                    # in one of them, NaN propagates to both, and unlike a sum they cannot
                    # overflow on large finite values. aminmax is one vectorised read-only
                    # pass (on CPU, vector_norm(ord=inf) is an order of magnitude slower).
                    low, high = torch.aminmax(tensor)
                    finite = torch.isfinite(low).logical_and_(torch.isfinite(high))
                    flag.masked_fill_(finite.logical_not_(), 1.0)
                    if self._norms:
                        norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
                if self._norms:
                    square = self._squares.get(key)
                    if square is None:
                        self._squares[key] = norm.square().mul_(factor * factor)
                    else:
                        square.addcmul_(norm, norm, value=factor * factor)
        except Exception as exc:  # telemetry must never break a backward pass
            with self._lock:
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
        finished and before the next backward starts. Allocates one zeroed
        one-element tensor per known device for the next iteration; no host sync.

        Returns:
            Device string (``str(tensor.device)``, e.g. ``"cuda:0"``) to a float32
            tensor of shape ``(1,)`` on that device: 1. when that device's unreduced
            gradients held inf/NaN since the previous call, else 0. Every device marked
            at least once so far is present; empty before the first collective ran.
        """
        with self._lock:
            taken = self._flags
            self._flags = {key: _zero_flag(device) for key, device in self._devices.items()}
        return taken

    def peek(self) -> dict[str, torch.Tensor]:
        """This iteration's flags so far, without starting fresh ones (a rerun's read)."""
        with self._lock:
            return dict(self._flags)

    def peek_squares(self) -> dict[str, torch.Tensor]:
        """This iteration's squared norms so far, without starting afresh."""
        with self._lock:
            return dict(self._squares)

    def take_squares(self) -> dict[str, torch.Tensor]:
        """This iteration's squared norms by device (see :meth:`mark`), then start afresh.

        Called by the front-end right after :meth:`take`. Empty without ``norms`` or when
        no collective ran; no allocation, no sync.
        """
        with self._lock:
            taken, self._squares = self._squares, {}
        return taken

    def _flag_for(self, key: str, device: torch.device) -> torch.Tensor:
        # Slow path, first mark on a device: autograd may run hooks for several devices
        # on several threads, so creation is serialised.
        with self._lock:
            flag = self._flags.get(key)
            if flag is None:
                flag = _zero_flag(device)
                self._flags[key] = flag
                self._devices[key] = device
            return flag


def _zero_flag(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)
