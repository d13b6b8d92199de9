"""Turning a pending step's host values into a :class:`StepRecord` and running totals.

Runs on the telemetry thread (or in ``snapshot()``), never on the hot path.

Validating a record with pydantic costs about as much as everything else the telemetry
thread does for it, and on clean iterations nearly all of it is the same as the previous
record's: the identity, the optimizer details, the per-device counts, the top-K list.
:class:`RecordBuilder` therefore checks the few values that vary (scales, counts) and
each label or parameter name once, shares the unchanged immutable parts between records,
and builds the models without validating them again. Anything its checks cannot vouch for
goes through strict validation instead, which raises exactly as before; the exporter
validates every record strictly either way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.config import LABEL_PATTERN
from ampscope.rank.gradients.attribution import top_k
from ampscope.rank.telemetry.batches import batch_ids
from ampscope.rank.telemetry.identity import resolve_device
from ampscope.rank.telemetry.stats_record import StatsBuilder
from ampscope.reporter.fault_rule import Call, FaultRule, FaultState, Iteration, after_rerun
from ampscope.reporter.schema import (
    MAX_DEVICES,
    MAX_LABEL_LENGTH,
    MAX_NONFINITE_PARAMS,
    MAX_OPTIMIZERS,
    MAX_PARAM_NAME_LENGTH,
    SCALE_ALIGN_STEPS,
    AlignedScale,
    DeviceIdentity,
    NonfiniteApplied,
    NonfiniteCall,
    NonfiniteParam,
    OptimizerDetail,
    RankTotals,
    ScaleEvent,
    Setup,
    StepRecord,
    StepStats,
    WeatherTotals,
)
from ampscope.reporter.spike_rule import SpikeRule

_Model = TypeVar("_Model", bound=BaseModel)

_PARAM_NAME = re.compile(r'^[^\s"\\]+$')
"""The schema's ParamName pattern (see ampscope.reporter.schema)."""


class _Vouched:
    """Strings known to pass one of the schema's string checks (a length and a pattern),
    each checked once."""

    __slots__ = ("_max_length", "_passed", "_pattern")

    def __init__(self, pattern: re.Pattern[str], max_length: int) -> None:
        self._pattern = pattern
        self._max_length = max_length
        self._passed: set[str] = set()

    def __call__(self, value: str) -> bool:
        if value in self._passed:
            return True
        if type(value) is str and len(value) <= self._max_length and self._pattern.match(value):
            self._passed.add(value)
            return True
        return False


_NO_WEATHER = WeatherTotals(skipped_steps=0, found_inf_local={}, found_inf_origin={})
"""A rank's weather before its first weather iteration."""


@dataclass
class RunningTotals:
    """Cumulative counters of one rank, as the records' ``totals`` carry them.

    The dicts are replaced, never changed in place, once a record holds them.
    """

    steps: int = 0
    skipped_steps: int = 0
    backoffs: int = 0
    growths: int = 0
    found_inf_local: dict[str, int] = field(default_factory=dict)
    found_inf_origin: dict[str, int] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    min_scale: float | None = None
    max_scale: float | None = None
    last_growth_tracker: int | None = None
    aligned_scale: AlignedScale | None = None
    nonfinite_applied: int = 0
    first_nonfinite_applied: NonfiniteApplied | None = None
    faults: dict[str, int] = field(default_factory=dict)
    """The rank's own faults by kind (the fault rule's ``faults``)."""
    weather: WeatherTotals = field(default_factory=lambda: _NO_WEATHER)
    """What of the counters the fault rule called the scaler's weather; replaced, never
    changed, on a weather iteration only (rare after the warm-up)."""


def _count(counter: dict[str, int], flags: dict[str, bool]) -> dict[str, int]:
    """``counter`` plus one per true flag: the same dict when nothing changes, else a new one."""
    for device, flag in flags.items():
        if flag is not False or device not in counter:
            break
    else:
        return counter
    out = dict(counter)
    for device, found in flags.items():
        out[device] = out.get(device, 0) + int(found)
    return out


_SCALER = Setup()
"""An fp16 scaler whose gradient dtype is not known."""


def _own(origin: dict[str, bool], local: dict[str, bool], world_size: int) -> bool | None:
    """Whether this rank's own gradients held inf/NaN: its origin flags, or alone in its
    world its local ones; ``None`` when it cannot be told (no origin tracking)."""
    if origin:
        return any(origin.values())
    return any(local.values()) if world_size == 1 else None


_set = object.__setattr__
"""Sets a frozen model's instance state as pydantic stores it (bypassing its __setattr__)."""
_FIELD_NAMES: dict[type[BaseModel], set[str]] = {}
"""Per schema model: the set of its field names, shared as ``model_fields_set`` by every
instance :func:`_build` gives all fields (every call here does)."""


def _build(cls: type[_Model], validate: bool, fields: dict[str, Any]) -> _Model:
    """A ``cls`` of ``fields`` (every field, by name; the dict becomes the model's own):
    strictly validated when ``validate``, else as checked by :class:`RecordBuilder`. A
    dict display at the call, not keywords: one dict, built in one step."""
    if validate:
        return cls(**fields)
    # Values were checked by RecordBuilder; what strict validation would do on top is
    # only to copy them. Frozen models: set the instance state as pydantic stores it.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = set(cls.model_fields)
    # One set per model class instead of one per instance (a container less per model
    # for the garbage collector to track): frozen models never change theirs, and
    # pydantic copies it before any change (model_copy). Every call here passes every
    # field by its name (the strict-validation tests compare each record's fields), so
    # the count tells a full set.
    fields_set = names if len(fields) == len(names) else set(fields)
    model = cls.__new__(cls)
    _set(model, "__dict__", fields)
    _set(model, "__pydantic_fields_set__", fields_set)
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


class RecordBuilder:
    """Builds each pending step's record and keeps the running totals. Not thread-safe:
    :class:`~ampscope.rank.telemetry.pipeline.Telemetry` calls it under its resolve lock.

    Args:
        k: How many parameters a record and the totals name at most.
        spike_rule: The rank's own spike rule for its loss and gradient norm.
    """

    def __init__(
        self, k: int, spike_rule: SpikeRule | None = None, fault_rule: FaultRule | None = None
    ) -> None:
        self.totals = RunningTotals()
        self.faults = FaultState(fault_rule)
        """The fault rule's state over this rank's whole history (``fault_threshold``)."""
        self._k = k
        self.stats = StatsBuilder(k, spike_rule)
        self._label = _Vouched(LABEL_PATTERN, MAX_LABEL_LENGTH)
        self._param_name = _Vouched(_PARAM_NAME, MAX_PARAM_NAME_LENGTH)
        self._details: dict[tuple[OptimizerSlot, bool], OptimizerDetail] = {}
        self._detail_lists: dict[tuple[Any, ...], list[OptimizerDetail]] = {}
        self._flags: dict[tuple[tuple[str, ...], tuple[bool, ...]], dict[str, bool]] = {}
        self._top: list[NonfiniteParam] = []
        self._no_params: list[NonfiniteParam] = []
        self._vouched_shape: tuple[Any, ...] | None = None
        """The newest (optimizers, local devices, origin devices) that passed the checks."""
        self.device: DeviceIdentity | None = None
        """The rank's device, resolved for its first record, which alone carries it."""

    def build(self, pending: PendingStep, values: list[float]) -> StepRecord:
        """The record of ``pending``; the totals include it afterwards.

        A scaler's iteration skipped its step when a stepped optimizer found inf/NaN. A
        watch (``setup.mode == "watch"``) has no scale: its values carry a scale of 1 and
        a tracker of 0, its event is always ``none`` and its totals hold no scale. Under
        ``observe`` a stepped optimizer that found inf/NaN applied the update instead of
        skipping it (``nonfinite_applied``). Where the front-end says what the library did
        (``pending.applied``, DeepSpeed), that decides instead of the policy, for a
        scaler's record too: an applied step is no skip and no backoff unless the scale
        fell (its event follows the scale).

        Raises:
            pydantic.ValidationError: a value the schema rejects (e.g. an infinite scale);
                the totals are then unchanged.
        """
        totals = self.totals
        setup = pending.setup or _SCALER
        watch = setup.mode == "watch"
        decoded = layout.decode(
            values, pending.optimizers, pending.local_devices, pending.origin_devices
        )
        stepped = decoded.stepped_on_nonfinite
        if pending.applied is None:
            applied = watch and setup.policy == "observe" and stepped
        else:  # the front-end saw what the library did (DeepSpeed), scaler or watch
            applied = pending.applied and stepped
        skipped = stepped and not applied
        found_global = True in decoded.optimizer_found
        local = self._flag_dict(pending.local_devices, decoded.local)
        origin = self._flag_dict(pending.origin_devices, decoded.origin)
        scale_before, scale_after = decoded.scale_before, decoded.scale_after
        tracker = decoded.growth_tracker

        event: ScaleEvent
        if watch:
            event = "none"
        elif pending.manual:
            event = "manual"
        elif found_global and not applied:
            event = "backoff"
        elif applied:
            # A scaler's step that ran on inf/NaN (DeepSpeed): the scale says what it did.
            event = (
                "backoff"
                if scale_after < scale_before
                else "growth"
                if scale_after > scale_before
                else "none"
            )
        elif tracker == 0:
            # Without found-inf, torch's update either grows the scale and resets the
            # tracker to 0 or increments the tracker: 0 here means it grew (even if a
            # clamp held it).
            event = "growth"
        else:
            event = "none"

        local_counts = _count(totals.found_inf_local, local)
        origin_counts = _count(totals.found_inf_origin, origin)
        nonfinite = totals.nonfinite
        if pending.nonfinite:
            nonfinite = dict(nonfinite)
            for name, count in pending.nonfinite.items():
                nonfinite[name] = nonfinite.get(name, 0) + count
        min_scale, max_scale = totals.min_scale, totals.max_scale
        aligned = totals.aligned_scale
        new_aligned = False
        if not watch:  # a watch has no scale to keep
            # min() and max() of the pairs, spelled out: min(a, b) is b only if b < a.
            for scale in (scale_before, scale_after):
                if min_scale is None or scale < min_scale:
                    min_scale = scale
                if max_scale is None or scale > max_scale:
                    max_scale = scale
            new_aligned = pending.step % SCALE_ALIGN_STEPS == 0

        validate = not (
            self._checked(pending, scale_before, scale_after, tracker)
            and len(local_counts) <= MAX_DEVICES
            and len(origin_counts) <= MAX_DEVICES
        )
        # Any inf/NaN, here or on another rank: for the fault rule, and for the stats an
        # overflow, whose values say nothing of the training's trend (out of the windows).
        nonfinite_any = found_global or True in local.values() or True in origin.values()
        stats = None
        scalars: Sequence[float] = ()
        taken = pending.stats
        if taken is not None:
            scalars = self.stats.host_scalars(
                taken, values, decoded.stats_at, on_host=pending.values is not None
            )
            fields, named = self.stats.build(
                taken,
                scalars,
                overflow=nonfinite_any,
                scale=1.0 if watch else scale_before,
                host_norms=pending.host_norms,
            )
            stats = _build(StepStats, validate or named, fields)
        call = self._call(
            pending,
            scalars,
            Iteration(
                scaler=not watch,
                nonfinite=nonfinite_any,
                own=_own(origin, local, pending.identity.world_size),
                scale_before=scale_before,
                scale_after=scale_after,
                growth_tracker=tracker,
                grew=event == "growth",
                manual=pending.manual,
                after_applied=totals.first_nonfinite_applied is not None,
                applied=applied,
            ),
        )
        faults = totals.faults
        if call is not None and call.cls == "fault" and call.own:
            faults = {**faults, call.kind: faults.get(call.kind, 0) + 1}
        weather = totals.weather
        if call is not None and call.cls == "weather":
            weather = _build(
                WeatherTotals,
                validate,
                {
                    "skipped_steps": weather.skipped_steps + int(skipped),
                    "found_inf_local": _count(weather.found_inf_local, local),
                    "found_inf_origin": _count(weather.found_inf_origin, origin),
                },
            )
        details = self._details_of(pending.optimizers, decoded.optimizer_found, validate)
        fp8 = None
        if pending.fp8 is not None:
            from ampscope.rank.fp8.record import fp8_entries

            fp8 = fp8_entries(pending.fp8, pending.read_extra(), 1.0 if watch else scale_before)
        if new_aligned:
            aligned = _build(AlignedScale, validate, {"step": pending.step, "scale": scale_after})
        first_applied = totals.first_nonfinite_applied
        if applied and first_applied is None:
            first_applied = _build(
                NonfiniteApplied,
                validate,
                {"step": pending.step, "origin": any(origin.values()) if origin else None},
            )
        top = self._top if nonfinite is totals.nonfinite and not validate else None
        if top is None:
            top = [
                _build(NonfiniteParam, validate, {"name": n, "count": c})
                for n, c in top_k(nonfinite, self._k)
            ]
        step_params = (
            [
                _build(NonfiniteParam, validate, {"name": n, "count": c})
                for n, c in top_k(dict(pending.nonfinite), self._k)
            ]
            if pending.nonfinite
            else self._no_params
        )
        steps = totals.steps + 1
        skipped_steps = totals.skipped_steps + int(skipped)
        backoffs = totals.backoffs + int(event == "backoff")
        growths = totals.growths + int(event == "growth")
        nonfinite_applied = totals.nonfinite_applied + int(applied)
        device = None
        if self.device is None:
            # Once per run, off the hot path: torch's device properties, no sync.
            device = resolve_device(pending.identity, pending.local_devices)
        record = _build(
            StepRecord,
            validate,
            {
                "identity": pending.identity,
                "step": pending.step,
                "time": pending.time,
                "found_inf_local": local,
                "found_inf_origin": origin,
                "found_inf_global": found_global,
                "skipped": skipped,
                "scale_before": scale_before,
                "scale_after": scale_after,
                "growth_tracker": tracker,
                "event": event,
                "optimizers": details,
                "nonfinite_params": step_params,
                "stats": stats,
                "totals": _build(
                    RankTotals,
                    validate,
                    {
                        "steps": steps,
                        "skipped_steps": skipped_steps,
                        "backoffs": backoffs,
                        "growths": growths,
                        "found_inf_local": local_counts,
                        "found_inf_origin": origin_counts,
                        "nonfinite_params": top,
                        "min_scale": min_scale,
                        "max_scale": max_scale,
                        "aligned_scale": aligned,
                        "nonfinite_applied": nonfinite_applied,
                        "first_nonfinite_applied": first_applied,
                        "faults": faults,
                        "clean_scale": None if watch else self.faults.clean_scale,
                        "weather": weather,
                    },
                ),
                "setup": setup,
                "device": device,
                "batch": None if pending.batch is None else batch_ids(pending.batch),
                "fp8": fp8,
                "rerun": None if pending.rerun is None else pending.rerun.to_record(),
                "replicas": None if pending.replicas is None else pending.replicas.to_record(),
                "nonfinite": None
                if call is None
                else _build(
                    NonfiniteCall,
                    validate,
                    {
                        "kind": call.cls,
                        "reason": call.kind,
                        "own": call.own,
                        "clean_scale": call.clean_scale,
                    },
                ),
            },
        )
        # The record exists: only now do the totals move.
        if device is not None:
            self.device = device
        totals.steps, totals.skipped_steps = steps, skipped_steps
        totals.backoffs, totals.growths = backoffs, growths
        totals.found_inf_local, totals.found_inf_origin = local_counts, origin_counts
        totals.nonfinite = nonfinite
        totals.min_scale, totals.max_scale = min_scale, max_scale
        totals.last_growth_tracker = tracker
        totals.aligned_scale = aligned
        totals.nonfinite_applied, totals.first_nonfinite_applied = nonfinite_applied, first_applied
        totals.faults, totals.weather = faults, weather
        self._top = top
        return record

    def _call(
        self, pending: PendingStep, scalars: Sequence[float], iteration: Iteration
    ) -> Call | None:
        """The fault rule's decision about the step (``None``: clean); moves its state.

        Reads only host values the record already holds, plus the loss sum when stats are
        on: no device access. A rerun's record keeps its second pass: the rule judges that
        pass, and the rerun's own finding corrects it (``after_rerun``).
        """
        taken = pending.stats
        if taken is not None and taken.loss is not None and not math.isfinite(scalars[0]):
            iteration = replace(iteration, loss_nonfinite=True)
        call = self.faults.observe(iteration)
        rerun = pending.rerun
        if rerun is not None:
            call = after_rerun(
                call,
                rerun.flagged,
                rerun.reproduced,
                rerun.first.nonfinite,
                nonfinite=rerun.reason == "nonfinite",
            )
        return call

    # -- cheap checks, each standing for what strict validation would check --------------

    def _checked(
        self, pending: PendingStep, scale_before: float, scale_after: float, tracker: int
    ) -> bool:
        """Whether every value that strict validation would look at is known to pass."""
        return (
            pending.step >= 1
            and 0.0 <= pending.time < math.inf
            and 0.0 <= scale_before < math.inf  # a scale: False for NaN too
            and 0.0 <= scale_after < math.inf
            and tracker >= 0
            and (
                (pending.optimizers, pending.local_devices, pending.origin_devices)
                == self._vouched_shape
                or self._shape_checked(pending)
            )
            and (
                not pending.nonfinite
                or all(
                    self._param_name(name) and type(count) is int and count >= 0
                    for name, count in pending.nonfinite.items()
                )
            )
        )

    def _shape_checked(self, pending: PendingStep) -> bool:
        """Whether the step's optimizers and device names pass the schema's checks; a shape
        that passed is kept, and :meth:`_checked` compares each step's with it (tuples of
        the same objects, whatever the number of parameters) before calling this."""
        shape = (pending.optimizers, pending.local_devices, pending.origin_devices)
        passed = (
            len(pending.local_devices) <= MAX_DEVICES
            and len(pending.origin_devices) <= MAX_DEVICES
            and len(pending.optimizers) <= MAX_OPTIMIZERS
            and self._k <= MAX_NONFINITE_PARAMS
            and all(self._label(d) for d in pending.local_devices)
            and all(self._label(d) for d in pending.origin_devices)
            and all(self._label(slot.name) for slot in pending.optimizers)
        )
        if passed:
            self._vouched_shape = shape
        return passed

    # -- shared immutable parts ----------------------------------------------------------

    def _detail(self, slot: OptimizerSlot, found: bool, validate: bool) -> OptimizerDetail:
        key = (slot, found)
        detail = None if validate else self._details.get(key)
        if detail is None:
            detail = _build(
                OptimizerDetail,
                validate,
                {"index": slot.index, "name": slot.name, "found_inf": found, "fused": slot.fused},
            )
            if not validate:
                self._details[key] = detail
        return detail

    def _details_of(
        self, slots: tuple[OptimizerSlot, ...], found: list[bool], validate: bool
    ) -> list[OptimizerDetail]:
        """The record's ``optimizers``: one shared list per distinct (slots, flags), as
        records never change theirs; built afresh (and validated) when ``validate``."""
        key = (slots, tuple(found))
        details = None if validate else self._detail_lists.get(key)
        if details is None:
            details = [
                self._detail(slot, hit, validate) for slot, hit in zip(slots, found, strict=True)
            ]
            if not validate and len(self._detail_lists) < 1024:  # bounded, as _flags
                self._detail_lists[key] = details
        return details

    def _flag_dict(self, devices: tuple[str, ...], flags: tuple[bool, ...]) -> dict[str, bool]:
        """``{device: flag}``; one shared dict per distinct combination (records never
        change theirs)."""
        key = (devices, flags)
        out = self._flags.get(key)
        if out is None:
            out = dict(zip(devices, flags, strict=True))
            if len(self._flags) < 1024:  # bounded: devices x flags combinations
                self._flags[key] = out
        return out
