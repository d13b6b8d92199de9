"""Turning a pending step's host values into a :class:`StepRecord` and running totals.

Runs on the telemetry thread (or in ``snapshot()``), never on the hot path.
:meth:`RecordBuilder.build` goes through a step in five stages, each over host values
only:

1. **what the iteration did**: the decoded values, applied or skipped, the scale's event
   (:mod:`~ampscope.rank.telemetry.outcome`);
2. **counts and checks**: the per-device and per-parameter counts that include the step
   (:mod:`~ampscope.rank.telemetry.totals`), and whether the cheap checks vouch for the
   record (:mod:`~ampscope.rank.telemetry.vouching`);
3. **judgements**: the gradient statistics and their spikes
   (:mod:`~ampscope.rank.telemetry.stats_record`), and the fault rule's call;
4. **the models**: the record and its totals, sharing the parts that repeat
   (:mod:`~ampscope.rank.telemetry.shared_parts`), built without validating again what
   the checks vouched for, strictly validated otherwise;
5. **the totals move**, only once the record exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import StepValues
from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.telemetry.batches import batch_ids
from ampscope.rank.telemetry.identity import resolve_device
from ampscope.rank.telemetry.outcome import outcome
from ampscope.rank.telemetry.shared_parts import SharedParts
from ampscope.rank.telemetry.stats_record import StatsBuilder
from ampscope.rank.telemetry.totals import RunningTotals, add_counts, add_flags
from ampscope.rank.telemetry.vouching import RecordChecks, build_model
from ampscope.reporter.fault_rule import Call, FaultRule, FaultState, Iteration, after_rerun
from ampscope.reporter.schema import (
    SCALE_ALIGN_STEPS,
    AlignedScale,
    DeviceIdentity,
    NonfiniteApplied,
    NonfiniteCall,
    RankTotals,
    ScaleEvent,
    Setup,
    StepRecord,
    StepStats,
    WeatherTotals,
)
from ampscope.reporter.spike_rule import SpikeRule

__all__ = ["RecordBuilder", "RunningTotals"]

_SCALER = Setup()
"""An fp16 scaler whose gradient dtype is not known."""
_NO_FLAGS: dict[str, bool] = {}
"""The origin flags of every step without origin tracking (records never change theirs)."""


class RecordBuilder:
    """Builds each pending step's record and keeps the running totals. Not thread-safe:
    :class:`~ampscope.rank.telemetry.pipeline.Telemetry` calls it under its resolve lock.

    Args:
        k: How many parameters a record and the totals name at most.
        spike_rule: The rank's own spike rule for its loss and gradient norm.
        fault_rule: The rank's fault rule (``fault_threshold``).
    """

    def __init__(
        self, k: int, spike_rule: SpikeRule | None = None, fault_rule: FaultRule | None = None
    ) -> None:
        self.totals = RunningTotals()
        self.faults = FaultState(fault_rule)
        """The fault rule's state over this rank's whole history (``fault_threshold``)."""
        self.stats = StatsBuilder(k, spike_rule)
        self._checks = RecordChecks(k)
        self._parts = SharedParts(k)
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
        setup = pending.setup or _SCALER
        watch = setup.mode == "watch"

        # 1. What the iteration did.
        decoded = layout.decode(
            values, pending.optimizers, pending.local_devices, pending.origin_devices
        )
        # Read once: each read of a StepValues field is a descriptor call.
        scale_before, scale_after = decoded.scale_before, decoded.scale_after
        tracker = decoded.growth_tracker
        found_global, own, applied, skipped, event = outcome(
            decoded,
            watch,
            setup.policy,
            pending.applied,
            pending.manual,
            pending.identity.world_size,
        )
        local = self._parts.flags(pending.local_devices, decoded.local)
        # Without origin tracking (the default) there are no origin flags to name or count.
        origin = (
            self._parts.flags(pending.origin_devices, decoded.origin)
            if pending.origin_devices
            else _NO_FLAGS
        )

        # 2. The per-device counts with this step, and whether the checks vouch for it all.
        totals = self.totals
        local_counts = add_flags(totals.found_inf_local, local)
        origin_counts = (
            add_flags(totals.found_inf_origin, origin) if origin else totals.found_inf_origin
        )
        validate = not self._checks.vouch(
            pending, scale_before, scale_after, tracker, local_counts, origin_counts
        )

        # 3. Judgements: the gradient statistics, then the fault rule's call. Any inf/NaN,
        # here or on another rank, counts for the rule, and for the stats it is an
        # overflow, whose values say nothing of the training's trend (out of the windows).
        nonfinite_any = found_global or True in decoded.local or True in decoded.origin
        # What the gradients were multiplied by in backward: the values are unscaled by it.
        scaled_by = 1.0 if watch else scale_before
        stats, scalars = self._stats(
            pending, values, decoded.stats_at, scaled_by, nonfinite_any, validate
        )
        call = self._call(pending, scalars, decoded, watch, nonfinite_any, own, event, applied)

        # 4. The models: the record's parts, its totals, then the record itself.
        optimizers = self._parts.optimizers(pending.optimizers, decoded.optimizer_found, validate)
        fp8 = None if pending.fp8 is None else _fp8(pending, scaled_by)
        # A step that names no parameter keeps the counts' dict, and with it the totals'
        # list of the most counted (shared with the previous record).
        nonfinite = (
            add_counts(totals.nonfinite, pending.nonfinite)
            if pending.nonfinite
            else totals.nonfinite
        )
        carried, moved = self._carried_totals(
            pending,
            decoded,
            watch,
            event,
            skipped,
            applied,
            local,
            origin,
            call,
            local_counts,
            origin_counts,
            nonfinite,
            validate,
        )
        step_params = (
            self._parts.named(dict(pending.nonfinite), validate)
            if pending.nonfinite
            else self._parts.no_params
        )
        device = None
        if self.device is None:
            # Once per run, off the hot path: torch's device properties, no sync.
            device = resolve_device(pending.identity, pending.local_devices)
        record = build_model(
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
                "optimizers": optimizers,
                "nonfinite_params": step_params,
                "stats": stats,
                "totals": build_model(RankTotals, validate, carried),
                "setup": setup,
                "device": device,
                "batch": None if pending.batch is None else batch_ids(pending.batch),
                "fp8": fp8,
                "rerun": None if pending.rerun is None else pending.rerun.to_record(),
                "replicas": None if pending.replicas is None else pending.replicas.to_record(),
                "nonfinite": None if call is None else _nonfinite_call(call, validate),
            },
        )

        # 5. The record exists: only now do the totals move.
        if device is not None:
            self.device = device
        totals.take(moved)
        return record

    def _stats(
        self,
        pending: PendingStep,
        values: list[float],
        stats_at: int,
        scaled_by: float,
        overflow: bool,
        validate: bool,
    ) -> tuple[StepStats | None, Sequence[float]]:
        """The record's ``stats`` (``None`` when off) and the stats' host scalars (the
        loss first), which the fault rule reads; moves the spike windows."""
        taken = pending.stats
        if taken is None:
            return None, ()
        scalars = self.stats.host_scalars(
            taken, values, stats_at, on_host=pending.values is not None
        )
        fields, named = self.stats.build(
            taken,
            scalars,
            overflow=overflow,
            scale=scaled_by,
            host_norms=pending.host_norms,
        )
        # A step that names parameters (a spike) holds norms no check vouched for.
        return build_model(StepStats, validate or named, fields), scalars

    def _call(
        self,
        pending: PendingStep,
        scalars: Sequence[float],
        decoded: StepValues,
        watch: bool,
        nonfinite: bool,
        own: bool | None,
        event: ScaleEvent,
        applied: bool,
    ) -> Call | None:
        """The fault rule's decision about the step (``None``: clean); moves its state.

        Reads only host values the record already holds, plus the loss sum when stats are
        on (``scalars[0]``): no device access. A rerun's record keeps its second pass: the
        rule judges that pass, and the rerun's own finding corrects it (``after_rerun``).
        """
        taken = pending.stats
        loss = taken is not None and taken.loss is not None and not math.isfinite(scalars[0])
        call = self.faults.observe(
            Iteration(
                scaler=not watch,
                nonfinite=nonfinite,
                loss_nonfinite=loss,
                own=own,
                scale_before=decoded.scale_before,
                scale_after=decoded.scale_after,
                growth_tracker=decoded.growth_tracker,
                grew=event == "growth",
                manual=pending.manual,
                after_applied=self.totals.first_nonfinite_applied is not None,
                applied=applied,
            )
        )
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

    def _carried_totals(
        self,
        pending: PendingStep,
        decoded: StepValues,
        watch: bool,
        event: ScaleEvent,
        skipped: bool,
        applied: bool,
        local: dict[str, bool],
        origin: dict[str, bool],
        call: Call | None,
        local_counts: dict[str, int],
        origin_counts: dict[str, int],
        nonfinite: dict[str, int],
        validate: bool,
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """The running totals with this step: the fields of the record's ``totals``, and
        every field of :class:`RunningTotals` in its order (:meth:`RunningTotals.take`).

        Args:
            local: The step's local found-inf flags (a weather step's count as weather).
            origin: The step's origin flags (the first applied step's ``origin``; a
                weather step's count as weather).
            call: The fault rule's call on the step (a fault of its own counts; weather
                counts apart).
            local_counts: The found-inf counts per local device, with this step.
            origin_counts: The counts per origin device, with this step.
            nonfinite: The counts per parameter, with this step; the totals name the
                ``k`` largest, the previous list while none moved.
        """
        totals = self.totals
        min_scale, max_scale = totals.min_scale, totals.max_scale
        aligned = totals.aligned_scale
        if not watch:  # a watch has no scale to keep
            # min() and max() of the pairs, spelled out: min(a, b) is b only if b < a.
            for scale in (decoded.scale_before, decoded.scale_after):
                if min_scale is None or scale < min_scale:
                    min_scale = scale
                if max_scale is None or scale > max_scale:
                    max_scale = scale
            if pending.step % SCALE_ALIGN_STEPS == 0:
                aligned = build_model(
                    AlignedScale, validate, {"step": pending.step, "scale": decoded.scale_after}
                )
        first_applied = totals.first_nonfinite_applied
        if applied and first_applied is None:
            first_applied = build_model(
                NonfiniteApplied,
                validate,
                {"step": pending.step, "origin": any(origin.values()) if origin else None},
            )
        faults = totals.faults
        if call is not None and call.cls == "fault" and call.own:
            faults = {**faults, call.kind: faults.get(call.kind, 0) + 1}
        weather = totals.weather
        if call is not None and call.cls == "weather":
            weather = build_model(
                WeatherTotals,
                validate,
                {
                    "skipped_steps": weather.skipped_steps + int(skipped),
                    "found_inf_local": add_flags(weather.found_inf_local, local),
                    "found_inf_origin": add_flags(weather.found_inf_origin, origin),
                },
            )
        steps = totals.steps + 1
        skipped_steps = totals.skipped_steps + int(skipped)
        backoffs = totals.backoffs + int(event == "backoff")
        growths = totals.growths + int(event == "growth")
        applied_steps = totals.nonfinite_applied + int(applied)
        top = (
            totals.top
            if nonfinite is totals.nonfinite and not validate
            else self._parts.named(nonfinite, validate)
        )
        carried = {
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
            "nonfinite_applied": applied_steps,
            "first_nonfinite_applied": first_applied,
            "faults": faults,
            "clean_scale": None if watch else self.faults.clean_scale,
            "weather": weather,
        }
        # The same values again, as a tuple: taking them from the dict would cost a
        # lookup each.
        moved = (
            steps,
            skipped_steps,
            backoffs,
            growths,
            local_counts,
            origin_counts,
            nonfinite,
            min_scale,
            max_scale,
            decoded.growth_tracker,
            aligned,
            applied_steps,
            first_applied,
            faults,
            weather,
            top,
        )
        return carried, moved


def _fp8(pending: PendingStep, scaled_by: float) -> Any:
    """The record's ``fp8``, from the FP8 observations that came with the step."""
    assert pending.fp8 is not None
    from ampscope.rank.fp8.record import fp8_entries

    return fp8_entries(pending.fp8, pending.read_extra(), scaled_by)


def _nonfinite_call(call: Call, validate: bool) -> NonfiniteCall:
    """The record's ``nonfinite``: the fault rule's call on a step it did not find clean."""
    return build_model(
        NonfiniteCall,
        validate,
        {"kind": call.cls, "reason": call.kind, "own": call.own, "clean_scale": call.clean_scale},
    )
