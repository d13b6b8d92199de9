"""Turning a pending step's host values into a :class:`StepRecord` and running totals.

Runs on the telemetry thread (or in ``snapshot()``), never on the hot path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ampscope.reporter.schema import (
    SCALE_ALIGN_STEPS,
    AlignedScale,
    NonfiniteParam,
    OptimizerDetail,
    RankTotals,
    ScaleEvent,
    StepRecord,
)
from ampscope.scaler.attribution import top_k
from ampscope.scaler.capture import PendingStep


@dataclass
class RunningTotals:
    """Cumulative counters of one rank, as the records' ``totals`` carry them."""

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

    def copy(self) -> RunningTotals:
        return copy.deepcopy(self)

    def to_schema(self, k: int) -> RankTotals:
        return RankTotals(
            steps=self.steps,
            skipped_steps=self.skipped_steps,
            backoffs=self.backoffs,
            growths=self.growths,
            found_inf_local=dict(self.found_inf_local),
            found_inf_origin=dict(self.found_inf_origin),
            nonfinite_params=[NonfiniteParam(name=n, count=c) for n, c in top_k(self.nonfinite, k)],
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            aligned_scale=self.aligned_scale,
        )


def _count(counter: dict[str, int], flags: dict[str, bool]) -> None:
    for device, found in flags.items():
        counter[device] = counter.get(device, 0) + int(found)


def build_record(
    pending: PendingStep, values: list[float], totals: RunningTotals, k: int
) -> tuple[StepRecord, RunningTotals]:
    """The record of ``pending`` and the totals including it; ``totals`` is not modified.

    Raises:
        pydantic.ValidationError: a value the schema rejects (e.g. an infinite scale).
    """
    offset = 1
    details = []
    skipped = False
    for slot in pending.optimizers:
        found = any(v > 0 for v in values[offset : offset + slot.num_flags])
        offset += slot.num_flags
        skipped = skipped or (slot.stepped and found)
        details.append(
            OptimizerDetail(index=slot.index, name=slot.name, found_inf=found, fused=slot.fused)
        )
    found_global = any(d.found_inf for d in details)
    scale_before, scale_after, tracker = values[0], values[offset], int(values[offset + 1])
    offset += 2
    local = {d: values[offset + i] > 0 for i, d in enumerate(pending.local_devices)}
    offset += len(pending.local_devices)
    origin = {d: values[offset + i] > 0 for i, d in enumerate(pending.origin_devices)}

    event: ScaleEvent
    if pending.manual:
        event = "manual"
    elif found_global:
        event = "backoff"
    elif tracker == 0:
        # Without found-inf, torch's update either grows the scale and resets the tracker
        # to 0 or increments the tracker: 0 here means it grew (even if a clamp held it).
        event = "growth"
    else:
        event = "none"

    new = totals.copy()
    new.steps += 1
    new.skipped_steps += int(skipped)
    new.backoffs += int(event == "backoff")
    new.growths += int(event == "growth")
    _count(new.found_inf_local, local)
    _count(new.found_inf_origin, origin)
    for name, count in pending.nonfinite.items():
        new.nonfinite[name] = new.nonfinite.get(name, 0) + count
    for scale in (scale_before, scale_after):
        new.min_scale = scale if new.min_scale is None else min(new.min_scale, scale)
        new.max_scale = scale if new.max_scale is None else max(new.max_scale, scale)
    new.last_growth_tracker = tracker
    if pending.step % SCALE_ALIGN_STEPS == 0:
        new.aligned_scale = AlignedScale(step=pending.step, scale=scale_after)

    record = StepRecord(
        identity=pending.identity,
        step=pending.step,
        time=pending.time,
        found_inf_local=local,
        found_inf_origin=origin,
        found_inf_global=found_global,
        skipped=skipped,
        scale_before=scale_before,
        scale_after=scale_after,
        growth_tracker=tracker,
        event=event,
        optimizers=details,
        nonfinite_params=[
            NonfiniteParam(name=n, count=c) for n, c in top_k(dict(pending.nonfinite), k)
        ],
        totals=new.to_schema(k),
    )
    return record, new
