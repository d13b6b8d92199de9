"""The one layout of a step's values: written here, read here, named everywhere else.

Every pending step reaches the telemetry thread as one flat list of floats (on the device
transport, one stacked tensor copied to the host), in this order::

    [scale_before, *optimizer flags, *local flags,      # the head, captured before update()
     scale_after, growth_tracker, *origin flags,        # the tail, after update()
     *stats scalars]                                    # device transport only

* optimizer flags: each optimizer's found-inf values in update()'s order,
  :attr:`OptimizerSlot.num_flags` of them per optimizer;
* local flags: this rank's pre-reduction found-inf, one per local device (the max over
  the optimizers);
* origin flags: this rank's own gradients held inf/NaN inside the gradient collective,
  one per device (origin tracking);
* stats scalars: :meth:`~ampscope.rank.gradients.stats.TakenStats.scalars`.

A watch has no scale: it writes a scale of :data:`WATCH_SCALE` and a tracker of
:data:`WATCH_TRACKER`, so one record builder reads both kinds. The encoders take floats
(the host transport) or tensors (stacked for the device transport) alike.

On the device transport the step's one host copy carries two more parts after these
values, each a separate tail that is not decoded here but handed on whole::

    [*values, *per-parameter norms, *extra]

* per-parameter norms: the stats' (``PendingStep.host_norms``), read only on a spike
  iteration;
* extra: values a front-end sends with the step (``PendingStep.extra``: the FP8
  observations of :mod:`ampscope.rank.fp8`, named by ``PendingStep.fp8`` and decoded by
  :func:`ampscope.rank.fp8.record.fp8_entries`); on the host transport they stay apart,
  in ``extra``.

:func:`copy_parts` is the one place that cuts a copy into these parts, for the writer
(``copy_with_norms``) and the reader (``PendingStep``) alike.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

V = TypeVar("V")
"""A value of the layout: a float on the host, a 0-dim tensor before the copy."""

WATCH_SCALE = 1.0
"""The scale a watch writes before and after: it multiplies nothing."""
WATCH_TRACKER = 0.0
"""The growth tracker a watch writes."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSlot:
    """One optimizer's part of a pending step; its found-inf values sit in the step's values.

    Immutable and shared: a capture reuses one slot per distinct value.
    """

    index: int
    name: str
    fused: bool
    stepped: bool
    num_flags: int
    """How many per-device found-inf values of this optimizer the step's values hold."""


def head(scale_before: V, flags: Iterable[V]) -> list[V]:
    """The values captured before update(): the scale, then every optimizer flag followed
    by the local flags (``flags``, already in that order)."""
    out = [scale_before]
    out.extend(flags)
    return out


def tail(scale_after: V, growth_tracker: V, origin: Iterable[V]) -> list[V]:
    """The values captured after update(): the scale, the tracker, the origin flags."""
    out = [scale_after, growth_tracker]
    out.extend(origin)
    return out


def flag_count(optimizers: Sequence[OptimizerSlot], local_devices: Sequence[str]) -> int:
    """How many flags the head holds after its scale."""
    return sum(map(_NUM_FLAGS, optimizers)) + len(local_devices)


_NUM_FLAGS = operator.attrgetter("num_flags")


def clean_head(
    scale_before: float, optimizers: Sequence[OptimizerSlot], local_devices: Sequence[str]
) -> list[float]:
    """The head of an iteration known clean on the host: every flag 0, none copied."""
    head = [0.0] * (flag_count(optimizers, local_devices) + 1)
    head[0] = scale_before
    return head


SCALE_AFTER = 0
"""Where the scale after update() sits in the tail: in a copy of ``head + tail`` at
``len(head) + SCALE_AFTER``, in a copy of the tail alone at ``SCALE_AFTER``."""
_TRACKER = 1
_ORIGIN = 2


_SET = functools.partial(operator.lt, 0.0)
"""Whether a flag's value is set: ``_SET(v)`` is ``0.0 < v`` (NaN is not set), a C call
that ``map`` runs without a Python frame per value."""


class StepValues(NamedTuple):
    """A step's values, by name."""

    scale_before: float
    optimizer_found: list[bool]
    """Per optimizer slot: any of its flags set."""
    stepped_on_nonfinite: bool
    """An optimizer that was stepped (by torch, or by a watch) had a flag set: a scaler
    skipped its step, a watch skipped or (``observe``) applied it."""
    local: tuple[bool, ...]
    """Per local device (``PendingStep.local_devices``): its flag set."""
    scale_after: float
    growth_tracker: int
    origin: tuple[bool, ...]
    """Per origin device (``PendingStep.origin_devices``): its flag set."""
    stats_at: int
    """Where the stats' scalars start (device transport)."""


class CopyParts(NamedTuple):
    """Where each part of a device-transport host copy sits (slices of the copy)."""

    values: slice
    """The step's values: head, tail and stats scalars (:func:`decode` names them)."""
    norms: slice | None
    """The stats' per-parameter norms; ``None``: none copied."""
    extra: slice | None
    """The front-end's extra values; ``None``: none copied."""


def copy_parts(length: int, norm_count: int, extra_count: int) -> CopyParts:
    """The parts of a host copy of ``length`` values that ends with ``norm_count`` norms
    and then ``extra_count`` extra values."""
    norms_at = length - norm_count - extra_count
    extra_at = length - extra_count
    return CopyParts(
        values=slice(0, norms_at),
        norms=slice(norms_at, extra_at) if norm_count else None,
        extra=slice(extra_at, length) if extra_count else None,
    )


def _flags(values: Sequence[float], start: int, end: int) -> tuple[bool, ...]:
    """The flags ``values[start:end]``, each set when above 0; none or one (a rank with one
    device) without building a map."""
    if end == start:
        return ()
    if end == start + 1:
        return (values[start] > 0,)
    return tuple(map(_SET, values[start:end]))


def decode(
    values: Sequence[float],
    optimizers: Sequence[OptimizerSlot],
    local_devices: Sequence[str],
    origin_devices: Sequence[str],
) -> StepValues:
    """Name a step's values (telemetry thread). A flag is set when its value is above 0.

    Work per optimizer and device, never per parameter; no Python call per value (it
    runs once per record, where each Python call costs more than the comparisons)."""
    found = []
    stepped = False
    offset = 1
    for slot in optimizers:
        end = offset + slot.num_flags
        # One flag (one device): read it; several: one C pass over them.
        hit = values[offset] > 0 if slot.num_flags == 1 else any(map(_SET, values[offset:end]))
        found.append(hit)
        if hit and slot.stepped:
            stepped = True
        offset = end
    end = offset + len(local_devices)
    local = _flags(values, offset, end)
    scale_after = values[end + SCALE_AFTER]
    tracker = int(values[end + _TRACKER])
    offset = end + _ORIGIN
    end = offset + len(origin_devices)
    origin = _flags(values, offset, end)
    # tuple.__new__: the NamedTuple's own __new__ is a Python function.
    return tuple.__new__(
        StepValues, (values[0], found, stepped, local, scale_after, tracker, origin, end)
    )
