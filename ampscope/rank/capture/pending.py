"""A captured iteration on its way to the telemetry thread: :class:`PendingStep`.

The training thread fills a pending step and never touches it again; the telemetry thread
lays it out if the capture left that to it, waits for its values and builds the record.
The values follow :mod:`ampscope.rank.capture.layout`. Their way to the host is one of two:

* **host transport** (the CPU): the values are read at once, or on the telemetry thread
  (host memory, no sync), into a list;
* **device transport** (accelerators): the values are stacked into one small float32
  tensor (:func:`stack_scalars`) whose copy to pinned host memory starts without blocking
  (:func:`copy_with_norms`); the telemetry thread waits for its event.

A front-end may send extra device values with the step (``PendingStep.extra``: the FP8
observations): they travel in the same copy, as the layout's separate ``extra`` tail
(:func:`~ampscope.rank.capture.layout.copy_parts`), and the capture never looks inside them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.reporter.schema import Identity, Setup

if TYPE_CHECKING:
    from ampscope.rank.gradients.stats import TakenStats

_NO_COUNTS: Mapping[str, int] = MappingProxyType({})


class PendingStep:
    """One update()'s scalars, on the host or on their way there, plus what the host knows.

    :meth:`read` gives the values in the :mod:`~ampscope.rank.capture.layout`; on the
    device transport the stats' scalars follow them (their per-parameter norms stay
    apart: ``host_norms``, as do a front-end's extra values: ``host_extra``; on the host
    transport ``stats`` and ``extra`` hold CPU tensors). A plain
    class with positional arguments first: built on every update(), where a dataclass's
    keyword ``__init__`` costs over twice as much.
    """

    __slots__ = (
        "applied",
        "batch",
        "before",
        "clean",
        "deferred",
        "extra",
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
        "replicas",
        "rerun",
        "setup",
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
        deferred: tuple[Any, ...] | None = None,
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
        self.deferred = deferred
        """``(capture, *args)`` while the capture has left the lay-out to the telemetry
        thread: :meth:`read` first calls ``capture.lay_out(self, *args)``, which sets
        ``optimizers``, ``local_devices`` and ``setup`` (and ``values`` if still unread)."""
        self.clean = clean
        """Every found-inf value is zero and ``values``/``host`` hold only the layout's
        tail; the scale before is ``before``."""
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
        """Device transport, not clean, between before and after update(): the layout's
        head stacked on the device."""
        self.setup: Setup | None = None
        """What the rank runs; set by the capture's lay-out."""
        self.applied: bool | None = None
        """Whether the optimizer step ran, where the front-end knows it from what the
        library did rather than from its policy (DeepSpeed: the engine's decision,
        corrected by ampscope's reads); ``None``: the setup's policy says it (a scaler
        skips, a watch skips or under ``observe`` applies)."""
        self.stats: TakenStats | None = None
        """The loss and gradient norms' tensors and layout; ``None`` with ``stats=False``."""
        self.host_norms: torch.Tensor | None = None
        """Device transport: the tail of ``host`` holding the per-parameter norms, read
        only on a spike iteration; the values stop before it."""
        self.batch: tuple[list[Any], int] | None = None
        """The ids noted for the iteration (``note_batch``) and how many were left out."""
        self.extra: torch.Tensor | None = None
        """Extra values sent with the step, set by the front-end before the copy starts:
        a float32 vector; on the host transport (the CPU) read as it is."""
        self.host_extra: torch.Tensor | None = None
        """Device transport: the tail of ``host`` holding ``extra`` (after the norms)."""
        self.fp8: Any = None
        self.rerun: Any = None
        """The iteration's rerun (``ampscope.rank.frontends.rerun.RerunOutcome``), if any."""
        self.replicas: Any = None
        """The iteration's replica check (``ampscope.rank.replicas.check.ReplicaOutcome``),
        if any."""
        """What names ``extra``'s values (``ampscope.rank.fp8.observer.Fp8Taken``)."""

    def read(self) -> list[float]:
        """The step's scalars on the host; waits for the device copy (telemetry thread)."""
        if self.deferred is not None:
            capture, *args = self.deferred
            self.deferred = None
            capture.lay_out(self, *args)
        if self.ready is not None:
            # Events complete in order: an earlier step's copy (``before``) is done too.
            self.ready.synchronize()
        own: list[float]
        if self.values is not None:
            own = self.values
        else:
            assert self.host is not None
            host = self.host
            norms, extra = self.host_norms, self.host_extra
            if norms is not None or extra is not None:
                # shape[0], not len(): a tensor's __len__ is Python, several times dearer.
                parts = layout.copy_parts(
                    host.shape[0],
                    0 if norms is None else norms.shape[0],
                    0 if extra is None else extra.shape[0],
                )
                host = host[parts.values]
            own = host.tolist()
        if not self.clean:
            return own
        before = self.before
        if isinstance(before, tuple):
            earlier, index = before
            before = earlier[index].item()
        return layout.clean_head(before, self.optimizers, self.local_devices) + own

    def read_extra(self) -> list[float]:
        """``extra``'s values on the host; call after :meth:`read`, which waited for the
        copy (telemetry thread)."""
        if self.host_extra is not None:
            return self.host_extra.tolist()
        return [] if self.extra is None else self.extra.tolist()


def to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small device tensor to the host without blocking the caller.

    On CUDA the returned event is a blocking-sync one: the telemetry thread that waits on
    it sleeps until the copy lands. A default event is waited on by spinning (CUDA's
    automatic schedule with few contexts per core), which keeps a CPU core busy for as
    long as the host runs ahead of the device (``bench/gpu_event_wait.py``).
    """
    if values.device.type == "cpu":
        return values, None
    if values.device.type == "cuda":
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event(blocking=True)
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
    their parts of the host copy (:func:`~ampscope.rank.capture.layout.copy_parts`)."""
    extra = pending.extra
    norm_count = 0 if stats is None else stats.norm_count()
    if not norm_count and extra is None:
        return to_host_async(values)
    device, float32 = values.device, torch.float32
    parts = [values]
    if stats is not None and norm_count:
        for optimizer in stats.optimizers:
            if optimizer.count:
                # One stack per optimizer (its norms share a device), none when a clip
                # stacked them; a cast only when they are not float32 on the values' device.
                stacked = optimizer.packed
                if stacked is None:
                    stacked = torch.stack(optimizer.norms)
                if stacked.dtype is not float32 or stacked.device != device:
                    stacked = stacked.to(device=device, dtype=float32, non_blocking=True)
                parts.append(stacked)
    extra_count = 0
    if extra is not None:
        if extra.dtype is not float32 or extra.device != device:
            extra = extra.to(device=device, dtype=float32, non_blocking=True)
        parts.append(extra)
        extra_count = len(extra)
    host, ready = to_host_async(torch.cat(parts))
    where = layout.copy_parts(len(host), norm_count, extra_count)
    if where.norms is not None:
        pending.host_norms = host[where.norms]
    if where.extra is not None:
        pending.host_extra = host[where.extra]
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
