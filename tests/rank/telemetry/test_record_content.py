"""What the telemetry thread writes for realistic steps, field by field, against values
written out by hand (not against another run of the builder): a clean fp16 step with its
gradient norms, a skipped step that backs the scale off and names its parameters, and a
watch's NaN step applied under ``observe``. The telemetry thread's shortcuts (shared
immutable parts, one field-name set per model, the float64 scratch vector, the running
minimum of the spike windows) must leave every byte of these records as the schema says.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ampscope.rank.capture import layout
from ampscope.rank.capture.layout import OptimizerSlot
from ampscope.rank.capture.pending import PendingStep
from ampscope.rank.gradients.stats import OptimizerNorms, TakenStats
from ampscope.rank.telemetry.records import RecordBuilder
from ampscope.reporter.schema import Identity, Setup, StepRecord

IDENTITY = Identity(run="run-1", node="n0", rank=0, local_rank=0, world_size=1)
ADAMW = OptimizerSlot(index=0, name="AdamW", fused=False, stepped=True, num_flags=1)
NAMES = tuple(f"h.{i // 4}.p{i % 4}" for i in range(148))
NORMS = torch.arange(1, 149, dtype=torch.float32)
"""148 per-parameter norms 1..148: their squares sum to 148*149*297/6 = 1,091,574, exactly
in float64 whatever the order of the sum, so the expected norm needs no re-computation."""
SQUARES = 1_091_574.0
FP16 = Setup(mode="scaler", policy="skip", grad_dtype="float16")
OBSERVE = Setup(mode="watch", policy="observe", grad_dtype="bfloat16")


def _stats(loss: float) -> TakenStats:
    optimizer = OptimizerNorms(NAMES, (), scaled=False, square=None, packed=NORMS.clone())
    return TakenStats(torch.tensor(loss), 1, (optimizer,), {})


def _pending(
    step: int,
    values: list[float],
    setup: Setup,
    *,
    nonfinite: dict[str, int] | None = None,
    loss: float = 2.5,
) -> PendingStep:
    pending = PendingStep(
        IDENTITY,
        step,
        1_700_000_000.0 + step,
        False,
        nonfinite=nonfinite or {},
        optimizers=(ADAMW,),
        local_devices=("cpu",),
        values=values,
    )
    pending.setup = setup
    pending.stats = _stats(loss)
    return pending


def _json(record: StepRecord) -> dict[str, Any]:
    """What a sink sends (the reporter's encoding), without the device: only the first
    record carries it, and its hostname is this machine's."""
    data = json.loads(record.model_dump_json())
    data.pop("device")
    return data


def _record(**changes: Any) -> dict[str, Any]:
    """A record of this file's rank with every field written out; ``changes`` on top."""
    base: dict[str, Any] = {
        "identity": {
            "run": "run-1",
            "node": "n0",
            "rank": 0,
            "local_rank": 0,
            "world_size": 1,
            "local_world_size": None,
            "job_id": None,
        },
        "found_inf_origin": {},
        "batch": None,
        "fp8": None,
        "rerun": None,
        "replicas": None,
    }
    base.update(changes)
    return base


def test_clean_backoff_and_named_nan_steps_are_the_records_written_out_by_hand() -> None:
    builder = RecordBuilder(k=3)
    grad_norm = math.sqrt(SQUARES)
    clean = _pending(1, layout.head(1024.0, [0.0, 0.0]) + layout.tail(1024.0, 1.0, []), FP16)
    first = builder.build(clean, clean.read())
    assert first.device is not None
    assert first.device.device == "n0:0"
    expected_clean = _record(
        step=1,
        time=1_700_000_001.0,
        found_inf_local={"cpu": False},
        found_inf_global=False,
        skipped=False,
        scale_before=1024.0,
        scale_after=1024.0,
        growth_tracker=1,
        event="none",
        optimizers=[{"index": 0, "name": "AdamW", "found_inf": False, "fused": False}],
        nonfinite_params=[],
        stats={
            "loss": 2.5,
            "grad_norm": grad_norm,
            "grad_norm_origin": None,
            "spikes": [],
            "top_params": [],
        },
        totals={
            "steps": 1,
            "skipped_steps": 0,
            "backoffs": 0,
            "growths": 0,
            "found_inf_local": {"cpu": 0},
            "found_inf_origin": {},
            "nonfinite_params": [],
            "min_scale": 1024.0,
            "max_scale": 1024.0,
            "aligned_scale": None,
            "nonfinite_applied": 0,
            "first_nonfinite_applied": None,
            "faults": {},
            "clean_scale": None,
            "weather": {"skipped_steps": 0, "found_inf_local": {}, "found_inf_origin": {}},
        },
        setup={"mode": "scaler", "policy": "skip", "grad_dtype": "float16"},
        nonfinite=None,
    )
    assert _json(first) == expected_clean

    # The optimizer's and the local found-inf set: torch skipped the step and halved the
    # scale; the skipped step's parameters are named, largest count first.
    counts = {"h.1.p2": 1, "h.0.p0": 3, "h.7.p3": 3}
    backoff = _pending(
        2,
        layout.head(1024.0, [1.0, 1.0]) + layout.tail(512.0, 0.0, []),
        FP16,
        nonfinite=counts,
    )
    second = builder.build(backoff, backoff.read())
    named = [
        {"name": "h.0.p0", "count": 3},
        {"name": "h.7.p3", "count": 3},
        {"name": "h.1.p2", "count": 1},
    ]
    assert _json(second) == _record(
        step=2,
        time=1_700_000_002.0,
        found_inf_local={"cpu": True},
        found_inf_global=True,
        skipped=True,
        scale_before=1024.0,
        scale_after=512.0,
        growth_tracker=0,
        event="backoff",
        optimizers=[{"index": 0, "name": "AdamW", "found_inf": True, "fused": False}],
        nonfinite_params=named,
        stats={
            "loss": None,
            "grad_norm": None,
            "grad_norm_origin": None,
            "spikes": [],
            "top_params": [],
        },
        totals={
            "steps": 2,
            "skipped_steps": 1,
            "backoffs": 1,
            "growths": 0,
            "found_inf_local": {"cpu": 1},
            "found_inf_origin": {},
            "nonfinite_params": named,
            "min_scale": 512.0,
            "max_scale": 1024.0,
            "aligned_scale": None,
            "nonfinite_applied": 0,
            "first_nonfinite_applied": None,
            "faults": {},
            "clean_scale": None,
            # The warm-up backoff is weather: its skip and detection are counted apart.
            "weather": {"skipped_steps": 1, "found_inf_local": {"cpu": 1}, "found_inf_origin": {}},
        },
        setup={"mode": "scaler", "policy": "skip", "grad_dtype": "float16"},
        # No clean scale yet: the scaler is still warming up, its overflow is weather.
        nonfinite={"kind": "weather", "reason": "warmup", "own": True, "clean_scale": None},
    )
    # A later clean step shares the unchanged parts; the earlier records keep their bytes.
    third = _pending(3, layout.head(512.0, [0.0, 0.0]) + layout.tail(512.0, 1.0, []), FP16)
    builder.build(third, third.read())
    assert _json(first) == expected_clean
    assert _json(second)["totals"]["steps"] == 2


def test_a_watch_step_applied_on_named_nan_gradients_is_a_fault_written_out_by_hand() -> None:
    builder = RecordBuilder(k=2)
    clean = _pending(1, layout.head(1.0, [0.0, 0.0]) + layout.tail(1.0, 0.0, []), OBSERVE)
    builder.build(clean, clean.read())
    nan = _pending(
        2,
        layout.head(1.0, [1.0, 1.0]) + layout.tail(1.0, 0.0, []),
        OBSERVE,
        nonfinite={"lm_head.weight": 2, "h.3.p1": 5, "h.0.p0": 1},
    )
    record = builder.build(nan, nan.read())
    top = [{"name": "h.3.p1", "count": 5}, {"name": "lm_head.weight", "count": 2}]
    assert _json(record) == _record(
        step=2,
        time=1_700_000_002.0,
        found_inf_local={"cpu": True},
        found_inf_global=True,
        skipped=False,  # observe: the update ran on them
        scale_before=1.0,
        scale_after=1.0,
        growth_tracker=0,
        event="none",
        optimizers=[{"index": 0, "name": "AdamW", "found_inf": True, "fused": False}],
        nonfinite_params=top,
        stats={
            "loss": None,
            "grad_norm": None,
            "grad_norm_origin": None,
            "spikes": [],
            "top_params": [],
        },
        totals={
            "steps": 2,
            "skipped_steps": 0,
            "backoffs": 0,
            "growths": 0,
            "found_inf_local": {"cpu": 1},
            "found_inf_origin": {},
            "nonfinite_params": top,
            "min_scale": None,
            "max_scale": None,
            "aligned_scale": None,
            "nonfinite_applied": 1,
            "first_nonfinite_applied": {"step": 2, "origin": None},
            "faults": {"nonfinite_gradients": 1},
            "clean_scale": None,
            # A watch has no weather: its fault counts.
            "weather": {"skipped_steps": 0, "found_inf_local": {}, "found_inf_origin": {}},
        },
        setup={"mode": "watch", "policy": "observe", "grad_dtype": "bfloat16"},
        nonfinite={
            "kind": "fault",
            "reason": "nonfinite_gradients",
            "own": True,
            "clean_scale": None,
        },
    )


def test_a_grad_norm_spike_names_its_parameters_and_shared_parts_stay_untouched() -> None:
    """Twenty steady steps, then one whose norms are ten times larger: a spike whose record
    names the three largest parameters; the records before it keep their empty lists and
    their field names (shared between records, never changed)."""
    builder = RecordBuilder(k=3)
    records = []
    for step in range(1, 22):
        pending = _pending(
            step, layout.head(1024.0, [0.0, 0.0]) + layout.tail(1024.0, float(step), []), FP16
        )
        assert pending.stats is not None
        if step == 21:
            pending.stats.optimizers[0].packed.mul_(10.0)  # type: ignore[union-attr]
        records.append(builder.build(pending, pending.read()))
    spike = records[-1].stats
    assert spike is not None
    assert spike.spikes == ["grad_norm"]
    assert spike.grad_norm == math.sqrt(SQUARES * 100.0)
    assert [(p.name, p.norm) for p in spike.top_params] == [
        ("h.36.p3", 1480.0),
        ("h.36.p2", 1470.0),
        ("h.36.p1", 1460.0),
    ]
    for record in records[:-1]:
        assert record.stats is not None
        assert (record.stats.spikes, record.stats.top_params) == ([], [])
        assert record.stats.grad_norm == math.sqrt(SQUARES)
        assert record.model_fields_set == set(StepRecord.model_fields)
    # A copy with a change leaves the shared field names of the others alone.
    changed = records[0].model_copy(update={"step": 99})
    assert changed.step == 99
    assert records[1].model_fields_set == set(StepRecord.model_fields)
    assert StepRecord.model_validate_json(records[0].model_dump_json(), strict=True) == records[0]
