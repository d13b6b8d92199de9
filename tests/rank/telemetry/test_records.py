"""RecordBuilder: records built without re-validation are exactly what strict validation
accepts, and anything strict validation rejects is still rejected."""

from __future__ import annotations

import math
import random

import pydantic
import pytest

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.telemetry.records import RecordBuilder
from ampscope.reporter.schema import Identity, StepRecord, WeatherTotals

IDENTITY = Identity(run="run-1", node="n0", rank=0, local_rank=0, world_size=1)
SLOTS = (
    OptimizerSlot(index=0, name="AdamW", fused=False, stepped=True, num_flags=2),
    OptimizerSlot(index=1, name="SGD", fused=True, stepped=True, num_flags=1),
)


def _pending(
    step: int,
    values: list[float],
    *,
    local: tuple[str, ...] = ("cuda:0", "cuda:1"),
    origin: tuple[str, ...] = ("cuda:0",),
    nonfinite: dict[str, int] | None = None,
    slots: tuple[OptimizerSlot, ...] = SLOTS,
    manual: bool = False,
) -> PendingStep:
    return PendingStep(
        identity=IDENTITY,
        step=step,
        time=1_700_000_000.0 + step,
        manual=manual,
        optimizers=slots,
        local_devices=local,
        origin_devices=origin,
        nonfinite=nonfinite or {},
        values=list(values),
    )


def _values(
    before: float = 8.0,
    after: float = 8.0,
    tracker: float = 1.0,
    flags: tuple[float, ...] = (0, 0, 0, 0, 0),
    origin: tuple[float, ...] = (0,),
) -> list[float]:
    """A step's values; ``flags``: the optimizers' (SLOTS: 3), then the local ones (2)."""
    return layout.head(before, flags) + layout.tail(after, tracker, origin)


def _strict(record: StepRecord) -> StepRecord:
    """The record as the exporter sees it: serialised, then validated strictly."""
    return StepRecord.model_validate_json(record.model_dump_json(), strict=True)


def test_records_equal_their_strict_validation_over_a_random_run() -> None:
    rng = random.Random(3)
    builder = RecordBuilder(k=3)
    scale, tracker = 2.0**16, 0
    records = []
    for step in range(1, 301):
        overflow = rng.random() < 0.2
        flags = [float(overflow and rng.random() < 0.7) for _ in range(3)]
        overflow = any(flags)
        before = scale
        scale, tracker = (scale / 2, 0) if overflow else (scale, tracker + 1)
        local = [float(rng.random() < 0.3 and overflow), float(overflow)]
        origin = [float(rng.random() < 0.1)]
        nonfinite = (
            {f"layers.{rng.randrange(6)}.weight": rng.randrange(1, 9) for _ in range(2)}
            if overflow
            else {}
        )
        values = _values(before, scale, float(tracker), (*flags, *local), tuple(origin))
        record = builder.build(_pending(step, values, nonfinite=nonfinite), values)
        assert record == _strict(record)
        records.append(record)
    last = records[-1]
    assert last.totals.steps == 300
    assert last.totals.backoffs == sum(r.event == "backoff" for r in records)
    assert last.totals.skipped_steps == sum(r.skipped for r in records)
    assert last.totals.found_inf_local == {
        d: sum(r.found_inf_local[d] for r in records) for d in ("cuda:0", "cuda:1")
    }
    assert last.totals.aligned_scale is not None
    assert last.totals.aligned_scale.step == 300
    # Records keep their own values although they share unchanged parts.
    assert [r.totals.steps for r in records] == list(range(1, 301))


@pytest.mark.parametrize(
    ("values", "kwargs"),
    [
        (_values(before=math.inf), {}),  # scale_before not finite
        (_values(after=math.nan), {}),  # scale_after NaN
        (_values(after=-1.0), {}),  # negative scale
        (_values(), {"local": ("cuda 0", "cuda:1")}),  # bad label
        (_values(), {"nonfinite": {'bad"name': 1}}),
        (_values(), {"nonfinite": {"w": -1}}),
        (
            _values(flags=(0,)),
            {
                "slots": (
                    OptimizerSlot(index=0, name="My Opt", fused=False, stepped=True, num_flags=1),
                ),
                "local": (),
            },
        ),
    ],
)
def test_what_strict_validation_rejects_is_rejected_and_leaves_totals(
    values: list[float], kwargs: dict
) -> None:
    builder = RecordBuilder(k=8)
    good = _values()
    builder.build(_pending(1, good), good)
    before = (builder.totals.steps, builder.totals.found_inf_local, builder.totals.min_scale)
    with pytest.raises(pydantic.ValidationError):
        builder.build(_pending(2, values, **kwargs), values)
    assert (builder.totals.steps, builder.totals.found_inf_local, builder.totals.min_scale) == (
        before
    )
    # The builder goes on as before with the next valid step.
    record = builder.build(_pending(2, good), good)
    assert record.totals.steps == 2
    assert record == _strict(record)


def test_manual_and_growth_events() -> None:
    builder = RecordBuilder(k=8)
    values = _values(after=16.0, tracker=0.0)
    assert builder.build(_pending(1, values), values).event == "growth"
    assert builder.build(_pending(2, values, manual=True), values).event == "manual"


def test_the_first_record_alone_names_the_device() -> None:
    builder = RecordBuilder(k=3)
    # [scale before, 3 optimizer flags, 1 local flag, scale after, tracker, 1 origin flag]
    values = [[2.0**16, 0, 0, 0, 0, 2.0**16, step, 0] for step in (1, 2)]
    first, second = (
        builder.build(_pending(step, v, local=("cpu",)), v)
        for step, v in zip((1, 2), values, strict=True)
    )
    assert first.device is not None
    assert first.device.device == "n0:0"
    assert second.device is None
    assert _strict(first) == first


def test_a_step_the_front_end_says_was_applied_on_inf_nan() -> None:
    """``pending.applied`` (DeepSpeed) decides skip or applied in a scaler's record too: an
    applied step counts in nonfinite_applied, is no skip, and its event follows the scale;
    a real skip stays a skip with its backoff; ``None`` leaves a scaler's reading as is."""
    from ampscope.reporter.schema import Setup

    scaler_observe = Setup(mode="scaler", policy="observe", grad_dtype="float16")
    found = (1, 0, 0, 1, 0)  # the first optimizer's flag and a local one

    def build(
        builder: RecordBuilder, step: int, values: list[float], applied: bool | None
    ) -> StepRecord:
        pending = _pending(step, values)
        pending.setup = scaler_observe
        pending.applied = applied
        record = builder.build(pending, values)
        assert record == _strict(record)
        return record

    builder = RecordBuilder(k=3)
    clean = _values(before=8.0, after=8.0, tracker=1.0)
    build(builder, 1, clean, True)  # clean: applied, nothing to count
    kept = build(builder, 2, _values(8.0, 8.0, 2.0, found), True)
    assert (kept.skipped, kept.event, kept.totals.nonfinite_applied) == (False, "none", 1)
    assert kept.totals.first_nonfinite_applied is not None
    assert kept.totals.first_nonfinite_applied.step == 2
    assert kept.nonfinite is not None
    assert (kept.nonfinite.kind, kept.nonfinite.reason) == ("fault", "nonfinite_gradients")
    lowered = build(builder, 3, _values(8.0, 4.0, 0.0, found), True)
    assert (lowered.skipped, lowered.event) == (False, "backoff")
    skipped = build(builder, 4, _values(4.0, 2.0, 0.0, found), False)
    assert (skipped.skipped, skipped.event) == (True, "backoff")
    assert skipped.totals.nonfinite_applied == 2
    assert skipped.totals.skipped_steps == 1

    # A scaler's record without the front-end's word: found-inf is a skip, as ever.
    plain = RecordBuilder(k=3)
    values = _values(8.0, 4.0, 0.0, found)
    record = plain.build(_pending(1, values), values)
    assert (record.skipped, record.event, record.totals.nonfinite_applied) == (
        True,
        "backoff",
        0,
    )


# A scaler's run: its warm-up from a high init_scale, growth probes, overflows at the edge
# (the fault rule's weather) and inf/NaN below it (faults), over devices that change.
PHASES: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...] = (
    # (first step, local devices, origin devices): two GPUs with origin tracking on one;
    # then other GPUs, both tracked; then one GPU, origin tracking off; then the first again.
    (1, ("cuda:0", "cuda:1"), ("cuda:0",)),
    (181, ("cuda:1", "cuda:2"), ("cuda:1", "cuda:2")),
    (361, ("cuda:0",), ()),
    (451, ("cuda:0", "cuda:1"), ("cuda:0",)),
)
GROWTH_INTERVAL = 30
FITS = 2.0**15
"""The largest scale the gradients fit at: the scaler overflows above it."""


def _devices(step: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    local, origin = PHASES[0][1:]
    for first, phase_local, phase_origin in PHASES:
        if step >= first:
            local, origin = phase_local, phase_origin
    return local, origin


def _within(part: dict[str, int], whole: dict[str, int]) -> bool:
    return all(device in whole and n <= whole[device] for device, n in part.items())


def test_a_scalers_weather_stays_within_its_totals_over_a_long_run() -> None:
    """Every record of a 600-step fp16 run validates strictly (the schema holds the weather
    to its totals), and the weather, checked here by hand, is within the totals in every
    record and never falls: skipped steps, and local and origin detections device by device,
    also for devices that came and went."""
    rng = random.Random(7)
    builder = RecordBuilder(k=3)
    scale, tracker = 2.0**24, 0  # the warm-up backs off to FITS: weather
    last: WeatherTotals | None = None
    for step in range(1, 601):
        local, origin = _devices(step)
        # Above FITS the gradients overflow on the device holding the largest (the last);
        # at any scale, now and then, inf/NaN comes from one device of its own (a fault
        # unless the scale is near the edge).
        by_scale = scale > FITS
        fault = rng.random() < 0.04
        culprit = rng.randrange(len(local))
        local_flags = [
            float((by_scale and i == len(local) - 1) or (fault and i == culprit))
            for i in range(len(local))
        ]
        origin_flags = [
            float((by_scale and rng.random() < 0.8) or (fault and device == local[culprit]))
            for device in origin
        ]
        overflow = by_scale or fault
        opt_flags = [float(overflow)] * 3
        before = scale
        if overflow:
            scale, tracker = scale / 2, 0
        elif tracker + 1 == GROWTH_INTERVAL:
            scale, tracker = scale * 2, 0
        else:
            tracker += 1
        values = _values(
            before, scale, float(tracker), (*opt_flags, *local_flags), tuple(origin_flags)
        )
        nonfinite = {"layers.0.weight": 3} if overflow else {}
        record = builder.build(
            _pending(step, values, local=local, origin=origin, nonfinite=nonfinite), values
        )
        assert record == _strict(record)
        totals, weather = record.totals, record.totals.weather
        assert weather is not None
        assert weather.skipped_steps <= totals.skipped_steps
        assert _within(weather.found_inf_local, totals.found_inf_local), step
        assert _within(weather.found_inf_origin, totals.found_inf_origin), step
        if last is not None:  # cumulative: never falls
            assert weather.skipped_steps >= last.skipped_steps
            assert _within(last.found_inf_local, weather.found_inf_local), step
            assert _within(last.found_inf_origin, weather.found_inf_origin), step
        last = weather

    # The run held all of it: weather and faults apart, on every device that came.
    assert weather is not None
    assert totals.faults
    assert 0 < weather.skipped_steps < totals.skipped_steps
    assert set(totals.found_inf_local) == {"cuda:0", "cuda:1", "cuda:2"}
    assert set(totals.found_inf_origin) == {"cuda:0", "cuda:1", "cuda:2"}
    assert len([n for n in weather.found_inf_local.values() if n]) >= 2
    assert len([n for n in weather.found_inf_origin.values() if n]) >= 2
    assert any(weather.found_inf_local.get(d, 0) < n for d, n in totals.found_inf_local.items())
