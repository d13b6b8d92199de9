"""``ampscope.integrations.deepspeed.instrument`` with the real DeepSpeed on 2 gloo ranks.

One launch per scenario group (the ranks build several engines one after the other):
ZeRO 0-3 in bf16 (with the replica check at every step, a flipped bit at ZeRO 0-2, and a
rank that closes its monitor early) and fp32 at ZeRO-0,
fp16 at ZeRO 0 and 2 (with a TEST-ONLY override of the CPU
accelerator's ``is_fp16_supported``: see ``deepspeed_workers.setup``), and 50 clean steps.
Every instrumented engine is compared bit for bit with the same training without ampscope.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from checks import exporter_ranks
from deepspeed_workers import (
    AGREE,
    AUTOCAST_BURST_STEP,
    CLOSE_AFTER,
    FLIP_PARAM,
    FLIP_STEP,
    FLIP_STEPS,
    FP16_NAN_STEP,
    FP16_PRECISION,
    FP16_STEPS,
    NAN_RANK,
    NAN_SAMPLE,
    NAN_STEP,
    PARAMS,
    STEPS,
    bf16_stages,
    fp16_stages,
    hugging_face_runs,
)
from support import get_json, need_module, run_distributed

need_module("deepspeed")

pytestmark = pytest.mark.distributed

_ENV = {"DS_ACCELERATOR": "cpu"}


def _health(url: str, run: str, steps: int) -> dict[str, dict[str, Any]]:
    exporter_ranks(url, run, 2, steps=steps)
    return {v["rule"]: v for v in get_json(f"{url}/api/v1/runs/{run}/health")["verdicts"]}


def _check_origin(
    results: list[dict[str, Any]], key: str, nan_step: int, steps: int, *, only_nan: bool = True
) -> None:
    """At the NaN step only the NaN rank's own gradients held inf/NaN, every parameter of
    it named, and the other rank names none; with ``only_nan``, no other step held any."""
    for rank, result in enumerate(results):
        records = result[key]["records"]
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        for record in records:
            if record["step"] != nan_step and not only_nan:
                continue
            own = rank == NAN_RANK and record["step"] == nan_step
            assert record["found_inf_origin"] == {"cpu": own}, (key, rank, record["step"])
            names = {p["name"] for p in record["nonfinite_params"]}
            assert names == (set(PARAMS) if own else set()), (key, rank, record["step"])
        assert records[nan_step - 1]["found_inf_global"], (key, rank)


_ORIGIN_CHECK = {
    0: "BoundaryGradientFlags",
    1: "BoundaryGradientFlags",
    2: "BucketGradientFlags",
    3: "BucketGradientFlags",
}
"""Per ZeRO stage, the origin check the monitor picks from where DeepSpeed 0.19.8 reduces
(``deepspeed.reduction``): one check before the boundary's reduction at ZeRO-0/1, one per
bucket at ZeRO-2 and ZeRO-3 (three buckets per backward there: ``ZERO3_BUCKETS``), a hook per
parameter elsewhere. Fails when a release moves them."""


def _check_origin_point(result: dict[str, Any], stage: int) -> None:
    assert result["origin_check"] == _ORIGIN_CHECK.get(stage, "OwnGradientFlags"), stage
    assert result["unwrapped"], stage
    # DeepSpeed's overflow flag or norm says it on every rank: no check after the reduction.
    assert not result["reduced_check"], stage


def _check_no_reads_added(ours: dict[str, Any], plain: dict[str, Any]) -> None:
    """The training thread's host reads (``aten._local_scalar_dense``: item(), bool(t)...)
    in ``step()`` are DeepSpeed's own: ampscope adds none. Its values take the device
    transport here too (one vector, decoded on the telemetry thread; on the CPU the vector
    is the host copy). The first step is left out: it resolves the rank's identity (a
    collective, once per monitor)."""
    assert [s["reads"] for s in ours["seen"][1:]] == [s["reads"] for s in plain["seen"][1:]]


def _check_as_deepspeed(result: dict[str, Any]) -> None:
    """Each record's skip is DeepSpeed's (``was_step_applied``), the same on every rank."""
    records, seen = result["records"], result["seen"]
    assert [r["skipped"] for r in records] == [not s["applied"] for s in seen]
    assert [r["found_inf_global"] for r in records] == [s["overflow"] for s in seen]
    assert records[-1]["totals"]["skipped_steps"] == seen[-1]["skipped_steps"]


@pytest.fixture(scope="module")
def bf16_results(exporter: Any) -> list[dict[str, Any]]:
    """One launch for every bf16 scenario, reporting to the session's exporter."""
    env = {**_ENV, "AMPSCOPE_URL": exporter.url}
    return run_distributed(bf16_stages, 2, env=env, timeout=600)


def test_bf16_zero_stages(bf16_results: list[dict[str, Any]], report_to: str) -> None:
    results = bf16_results
    for stage in (0, 1, 2, 3):
        key = f"ours{stage}"
        for result in results:
            ours = result[key]
            # Observe-only: bit for bit the training without ampscope.
            assert ours["weights"] == result[f"plain{stage}"]["weights"], stage
            assert not any(map(math.isnan, ours["weights"]))
            _check_as_deepspeed(ours)
            _check_origin_point(ours, stage)
            assert [r["skipped"] for r in ours["records"]] == [
                step == NAN_STEP for step in range(1, STEPS + 1)
            ]
            for record in ours["records"]:
                assert record["setup"] == {
                    "mode": "watch",
                    "policy": "skip",
                    "grad_dtype": "bfloat16",
                }
                assert record["scale_before"] == record["scale_after"] == 1.0
                assert record["event"] == "none"
                norm = record["stats"]["grad_norm"]
                assert (norm is None) == (record["step"] == NAN_STEP)
                assert (record["stats"]["loss"] is None) == (record["step"] == NAN_STEP)
                # Gradient accumulation: both micro-batches' ids in the step's record.
                rank = record["identity"]["rank"]
                assert record["batch"]["ids"] == [
                    f"r{rank}s{record['step']}m{micro}" for micro in (0, 1)
                ]
        _check_origin(results, key, NAN_STEP, STEPS)
        # The norm is DeepSpeed's global one: the same on both ranks.
        norms = [[r["stats"]["grad_norm"] for r in result[key]["records"]] for result in results]
        assert norms[0] == norms[1]
        for result in results:  # without a loss scaler, inf/NaN gradients are a fault
            nan = result[key]["records"][NAN_STEP - 1]
            if nan.get("nonfinite") is not None:
                assert nan["nonfinite"]["kind"] == "fault", nan
        verdict = _health(report_to, f"ds-bf16-z{stage}", STEPS)["nonfinite_skipped"]
        assert verdict["status"] == "warning", verdict
        assert verdict["evidence"]["origin_ranks"] == [NAN_RANK]
        assert verdict["evidence"]["last_step"] == NAN_STEP

    # check_grad_overflow: false: DeepSpeed applies the NaN and says nothing.
    for rank, result in enumerate(results):
        applied = result["applied"]
        assert all(s["applied"] and not s["overflow"] for s in applied["seen"])
        assert any(map(math.isnan, applied["weights"]))
        records = applied["records"]
        assert {r["setup"]["policy"] for r in records} == {"observe"}
        assert [r["skipped"] for r in records] == [False] * STEPS
        assert [r["found_inf_global"] for r in records] == [
            step >= NAN_STEP for step in range(1, STEPS + 1)
        ]
        totals = records[-1]["totals"]
        assert totals["nonfinite_applied"] == STEPS - NAN_STEP + 1
        assert totals["first_nonfinite_applied"] == {"step": NAN_STEP, "origin": rank == NAN_RANK}
    verdict = _health(report_to, "ds-applied", STEPS)["nonfinite_update_applied"]
    assert verdict["status"] == "critical", verdict
    assert verdict["evidence"]["first_step"] == NAN_STEP
    assert verdict["evidence"]["origin_ranks"] == [NAN_RANK]


def test_replica_check_at_zero_0_1_2_and_not_at_zero_3(
    bf16_results: list[dict[str, Any]], report_to: str
) -> None:
    # Healthy (the NaN step skipped included): every check agrees, at every step, on
    # every rank; ZeRO-3 partitions the parameters: no check, one log line saying so.
    for result in bf16_results:
        for stage in (0, 1, 2):
            records = result[f"ours{stage}"]["records"]
            assert [r["replicas"] for r in records] == [AGREE] * STEPS, stage
            assert result[f"ours{stage}"]["replica_logs"] == [], stage
        assert [r["replicas"] for r in result["ours3"]["records"]] == [None] * STEPS
        logs = result["ours3"]["replica_logs"]
        assert len(logs) == 1, logs
        assert "not made under DeepSpeed ZeRO-3" in logs[0], logs
    for stage in (0, 1, 2, 3):
        verdict = _health(report_to, f"ds-bf16-z{stage}", STEPS)["replica_divergence"]
        assert verdict["status"] == "ok", verdict
    # One bit of rank 1's copy flipped after the update: both ranks' check of that step
    # sees it (two replicas: no majority, both named) and names the parameter. ZeRO 0-2
    # rewrite the working weights from the fp32 master copy at every step, which heals it.
    flipped = {
        "agree": False,
        "replicas": 2,
        "ranks": [0, 1],
        "majority": False,
        "parameters": [FLIP_PARAM],
        "parameters_differing": 1,
    }
    for result in bf16_results:
        for stage in (0, 1, 2):
            checks = [r["replicas"] for r in result[f"flip{stage}"]["records"]]
            expected = [flipped if s == FLIP_STEP else AGREE for s in range(1, FLIP_STEPS + 1)]
            assert checks == expected, (stage, checks)
    verdict = _health(report_to, "ds-flip", FLIP_STEPS)["replica_divergence"]
    assert verdict["status"] == "critical", verdict
    evidence = verdict["evidence"]
    assert [e["rank"] for e in evidence["ranks"]] == [0, 1]
    assert (evidence["step"], evidence["parameters"], evidence["majority"]) == (
        FLIP_STEP,
        [FLIP_PARAM],
        False,
    )


def test_a_closed_monitor_keeps_its_part_in_the_replica_check(
    bf16_results: list[dict[str, Any]],
) -> None:
    """Rank 0 closes its monitor after step 2 and trains on: it still meets rank 1 in the
    check's all-gather (else rank 1 would wait in it for ever), and records nothing more.
    instrument() again on its engine returns that closed monitor and says so."""
    closing, going_on = (result["closed"]["records"] for result in bf16_results)
    assert [r["step"] for r in closing] == list(range(1, CLOSE_AFTER + 1))
    assert [r["replicas"] for r in going_on] == [AGREE] * FLIP_STEPS
    warned = [result["closed"]["closed_logs"] for result in bf16_results]
    assert len(warned[0]) == 1
    assert "records nothing more" in warned[0][0]
    assert warned[1] == []


@pytest.fixture(scope="module")
def fp16_results(exporter: Any) -> list[dict[str, Any]]:
    """One launch for every fp16 scenario (DeepSpeed's fp16 and its torch_autocast fp16
    mode), reporting to the session's exporter. fp16 on this CPU needs the TEST-ONLY
    ``is_fp16_supported`` override of ``deepspeed_workers.setup(fp16=True)``."""
    env = {**_ENV, "AMPSCOPE_URL": exporter.url}
    return run_distributed(fp16_stages, 2, env=env, timeout=600)


def test_fp16_backoffs_and_origin(fp16_results: list[dict[str, Any]], report_to: str) -> None:
    results = fp16_results
    initial = 2.0 ** FP16_PRECISION["initial_scale_power"]
    for stage in (0, 2):
        key = f"ours{stage}"
        for result in results:
            ours = result[key]
            assert ours["weights"] == result[f"plain{stage}"]["weights"], stage
            _check_as_deepspeed(ours)
            _check_origin_point(ours, stage)
            _check_no_reads_added(ours, result[f"plain{stage}"])
            records, seen = ours["records"], ours["seen"]
            # The scale trajectory is DeepSpeed's, read as a loss scaler's records read.
            scales = [initial] + [s["scale"] for s in seen]
            assert [r["scale_before"] for r in records] == scales[:-1]
            assert [r["scale_after"] for r in records] == scales[1:]
            for record in records:
                assert record["setup"] == {
                    "mode": "scaler",
                    "policy": "skip",
                    "grad_dtype": "float16",
                }
                before, after = record["scale_before"], record["scale_after"]
                if record["skipped"]:
                    assert record["event"] == "backoff"
                    assert after < before
                elif after > before:
                    assert record["event"] == "growth"
                    assert record["growth_tracker"] == 0
                else:
                    assert record["event"] == "none"
                    assert record["growth_tracker"] >= 1
            totals = records[-1]["totals"]
            assert totals["growths"] >= 1
            assert totals["backoffs"] == totals["skipped_steps"]
            assert totals["nonfinite_applied"] == 0
        _check_origin(results, key, FP16_NAN_STEP, FP16_STEPS, only_nan=False)
    # ZeRO-2 starts from a scale too high: backoffs that are weather, not the NaN...
    zero2 = [result["ours2"]["records"] for result in results]
    weather = [r["step"] for r in zero2[0] if r["skipped"] and r["step"] != FP16_NAN_STEP]
    assert weather
    # ...one of which no rank's own gradients held: born in the (summing) reduction.
    born = [
        step
        for step in weather
        if not any(records[step - 1]["found_inf_origin"]["cpu"] for records in zero2)
    ]
    assert born
    # The fault rule's call (StepRecord.nonfinite): the warm-up's backoffs, before the
    # first clean step, are the scaler's weather.
    for records in zero2:
        first_clean = next(r["step"] for r in records if not r["skipped"])
        assert first_clean > 1
        for record in records[: first_clean - 1]:
            assert record["nonfinite"]["kind"] == "weather", record
    health = _health(report_to, "ds-fp16-z2", FP16_STEPS)
    assert health["nonfinite_update_applied"]["status"] == "ok"


def test_a_parameter_deepspeed_does_not_step_raises_no_alarm(
    fp16_results: list[dict[str, Any]],
) -> None:
    """fp16 ZeRO-1 given only ``head``'s parameters: ``body``'s gradient is never zeroed and
    its sum overflows (a real inf, in a gradient no step uses). The records say what
    DeepSpeed's steps did (its own fp16 backoffs included), no step counts as applied on
    inf/NaN, and ``body`` is never named."""
    for result in fp16_results:
        ours = result["subset"]
        assert ours["body_overflowed"]
        _check_as_deepspeed(ours)
        assert any(s["applied"] for s in ours["seen"])
        for record in ours["records"]:
            assert record["totals"]["nonfinite_applied"] == 0, record
            names = {p["name"] for p in record["nonfinite_params"]}
            assert not {"body.weight", "body.bias"} & names, record


def test_fp16_autocast_growths_read_as_growths(fp16_results: list[dict[str, Any]]) -> None:
    """torch_autocast fp16 at ZeRO-2 with three parameter groups: DeepSpeed updates its
    GradScaler once per group in a step, so torch's tracker counts updates, not steps. A
    growth reads as a growth (tracker 0) even where torch's tracker is not 0 after it, and
    the overflow at the grown scale is the scaler probing (weather), not a fault."""
    for result in fp16_results:
        records, seen = result["autocast_groups"]["records"], result["autocast_groups"]["seen"]
        assert [r["scale_after"] for r in records] == [s["scale"] for s in seen]
        grew = [r["step"] for r in records if r["scale_after"] > r["scale_before"]]
        assert grew
        assert any(seen[step - 1]["tracker"] != 0 for step in grew), seen
        for record in records:
            growth = record["step"] in grew
            assert (record["event"] == "growth") == growth, record
            assert (record["growth_tracker"] == 0) == (growth or record["skipped"]), record
        burst = records[AUTOCAST_BURST_STEP - 1]
        assert burst["skipped"], burst
        assert burst["step"] > grew[0], grew
        assert not any((r.get("nonfinite") or {}).get("kind") == "fault" for r in records)
        assert burst["nonfinite"]["kind"] == "weather", burst


def test_fp16_autocast_records_say_what_happened(
    fp16_results: list[dict[str, Any]], report_to: str
) -> None:
    """DeepSpeed's torch_autocast fp16 mode (a torch GradScaler of its own): at ZeRO-0 the
    engine says it applied the NaN step its GradScaler skipped; at ZeRO-2 it skips without
    the GradScaler lowering its scale, and its norm is of the still scaled gradients. The
    records say what the weights did, and no verdict cries applied."""
    for stage in (0, 2):
        key = f"autocast{stage}"
        for result in fp16_results:
            ours = result[key]
            assert ours["weights"] == result[f"autocast_plain{stage}"]["weights"], stage
            assert not any(map(math.isnan, ours["weights"]))
            # No read of the GradScaler's scale (before or after) on the training thread.
            _check_no_reads_added(ours, result[f"autocast_plain{stage}"])
            records, seen = ours["records"], ours["seen"]
            # Ground truth: a step was skipped exactly when the weights did not move.
            still = [now["weights"] == then["weights"] for then, now in itertools.pairwise(seen)]
            assert [r["skipped"] for r in records[1:]] == still
            assert [r["skipped"] for r in records] == [
                step == FP16_NAN_STEP for step in range(1, FP16_STEPS + 1)
            ]
            nan = records[FP16_NAN_STEP - 1]
            assert nan["found_inf_global"]
            # What DeepSpeed says of that step: applied at ZeRO-0, a skip at ZeRO-2.
            said = seen[FP16_NAN_STEP - 1]
            expected = (True, 0) if stage == 0 else (False, 1)
            assert (said["applied"], said["skipped_steps"]) == expected
            # The GradScaler's scale, read as a scaler's records read: it backs off at
            # ZeRO-0; at ZeRO-2 DeepSpeed skips before it sees the NaN and it never lowers.
            assert [r["scale_after"] for r in records] == [s["scale"] for s in seen]
            assert nan["event"] == "backoff"
            assert (nan["scale_after"] < nan["scale_before"]) == (stage == 0)
            for record, step in zip(records, seen, strict=True):
                assert record["setup"] == {
                    "mode": "scaler",
                    "policy": "skip",
                    "grad_dtype": "float32",
                }
                if stage == 2 and not record["skipped"]:
                    # DeepSpeed's norm is of the gradients times the scale; the record's not.
                    norm = record["stats"]["grad_norm"]
                    assert norm == pytest.approx(step["norm"] / record["scale_before"])
                    assert norm < 10 < step["norm"]
            totals = records[-1]["totals"]
            assert (totals["skipped_steps"], totals["nonfinite_applied"]) == (1, 0)
        _check_origin(fp16_results, key, FP16_NAN_STEP, FP16_STEPS)
        health = _health(report_to, f"ds-autocast-z{stage}", FP16_STEPS)
        assert health["nonfinite_update_applied"]["status"] == "ok", stage


def test_fp16_autocast_composes_with_float8(fp16_results: list[dict[str, Any]]) -> None:
    """torchao Float8Linear (emulated) under DeepSpeed's torch_autocast fp16 at ZeRO-0: it
    trains, and the records carry the fp8 section as the other front-ends' do."""
    for result in fp16_results:
        fp8 = result["autocast_fp8"]
        if "missing" in fp8:
            need_module("torchao")  # skips here, fails under CI=true
        assert "error" not in fp8, fp8.get("error")
        records = fp8["records"]
        assert not any(r["skipped"] or r["found_inf_global"] for r in records)
        assert not any(map(math.isnan, fp8["weights"]))
        first = records[0]["fp8"]
        assert first, records[0]
        layers = {entry["layer"] for entry in first}
        assert layers == {"0", "2"}, layers
        # grad_output unscaled (divided by the GradScaler's 2**16): about 0.01 here.
        grads = [e["amax"] for e in first if e["tensor"] == "grad_output"]
        assert len(grads) == 2
        assert all(0 < amax < 1.0 for amax in grads), grads


def test_a_failed_record_leaves_no_stale_origin(bf16_results: list[dict[str, Any]]) -> None:
    """The NaN rank's record of the NaN step fails inside ampscope: that step has no record
    there, and the next step's says what its own (finite) gradients held, on every rank."""
    for stage in (0, 2):
        for rank, result in enumerate(bf16_results):
            records = result[f"failed{stage}"]["records"]
            steps = [r["step"] for r in records]
            lost = [NAN_STEP] if rank == NAN_RANK else []
            assert [s for s in range(1, STEPS + 1) if s not in steps] == lost, (stage, rank)
            for record in records:
                own = record["found_inf_origin"]["cpu"]
                assert own == (rank == NAN_RANK and record["step"] == NAN_STEP), record
                assert not record["totals"]["nonfinite_applied"], record


def test_unmanaged_accumulation_records_every_step(bf16_results: list[dict[str, Any]]) -> None:
    """``"managed_gradient_accumulation": false``: the caller calls ``step()`` at its own
    boundary only, where DeepSpeed says "boundary" only while ``step()`` runs. Every such
    call is an optimizer step with its record, the skip DeepSpeed's, the origin rank 1's."""
    for stage in (0, 2):
        key = f"unmanaged{stage}"
        for result in bf16_results:
            _check_as_deepspeed(result[key])
            assert [r["skipped"] for r in result[key]["records"]] == [
                step == NAN_STEP for step in range(1, STEPS + 1)
            ]
        _check_origin(bf16_results, key, NAN_STEP, STEPS)


def test_coalesced_reduction_checks_before_the_blocks_reduction(
    bf16_results: list[dict[str, Any]],
) -> None:
    """ZeRO-1 under ``engine.coalesce_grad_reduction()``: the backwards skip
    ``allreduce_gradients()`` and the block's exit reduces; the origin is still checked
    before that reduction (at the block's end): rank 1's own gradients at the NaN step
    only, every parameter named; the wraps come off at ``close()``."""
    for result in bf16_results:
        _check_as_deepspeed(result["coalesced"])
        assert result["coalesced"]["unwrapped"]
    _check_origin(bf16_results, "coalesced", NAN_STEP, STEPS)


def test_fifty_clean_steps_are_healthy(bf16_results: list[dict[str, Any]], report_to: str) -> None:
    for result in bf16_results:
        records = result["clean"]["records"]
        assert len(records) == 50
        assert not any(r["found_inf_global"] or r["skipped"] for r in records)
        assert not any(r["found_inf_origin"]["cpu"] for r in records)
        assert all(r["stats"]["grad_norm"] is not None for r in records)
    exporter_ranks(report_to, "ds-clean", 2, steps=50)
    health = get_json(f"{report_to}/api/v1/runs/ds-clean/health")
    assert health["status"] == "ok", health


def test_fp32_zero_0_every_rank_records_the_global_flag(
    bf16_results: list[dict[str, Any]], report_to: str
) -> None:
    """fp32 at ZeRO-0: the user's torch optimizer, no overflow flag, no norm. Rank 1's NaN
    reaches both ranks' reduced gradients and both apply it: the check of the reduced
    gradients makes both records say found and applied, from the NaN step on."""
    for rank, result in enumerate(bf16_results):
        ours, plain = result["fp32_0"], result["fp32_plain0"]
        assert list(map(repr, ours["weights"])) == list(map(repr, plain["weights"]))
        assert any(map(math.isnan, ours["weights"]))
        assert ours["reduced_check"]
        assert ours["origin_check"] == "BoundaryGradientFlags"
        assert all(s["applied"] and s["norm"] is None for s in ours["seen"])
        _check_no_reads_added(ours, plain)
        records = ours["records"]
        assert [r["found_inf_global"] for r in records] == [
            step >= NAN_STEP for step in range(1, STEPS + 1)
        ]
        assert [r["skipped"] for r in records] == [False] * STEPS
        nan = records[NAN_STEP - 1]
        assert nan["found_inf_origin"] == {"cpu": rank == NAN_RANK}
        assert nan["setup"] == {"mode": "watch", "policy": "observe", "grad_dtype": "float32"}
        totals = records[-1]["totals"]
        assert totals["nonfinite_applied"] == STEPS - NAN_STEP + 1
        assert totals["first_nonfinite_applied"] == {"step": NAN_STEP, "origin": rank == NAN_RANK}
    verdict = _health(report_to, "ds-fp32-z0", STEPS)["nonfinite_update_applied"]
    assert verdict["status"] == "critical", verdict
    evidence = verdict["evidence"]
    assert (evidence["first_step"], evidence["origin_ranks"]) == (NAN_STEP, [NAN_RANK])
    assert evidence["ranks_affected"] == 2, "every rank applied it"
    assert evidence["updates_applied"] == 2 * (STEPS - NAN_STEP + 1)


def test_instrument_needs_an_engine() -> None:
    from torch import nn

    from ampscope.integrations.deepspeed import instrument

    with pytest.raises(TypeError, match="DeepSpeed engine"):
        instrument(nn.Linear(2, 2), reporter=None)


def test_accelerate_and_trainer_observe_the_engine(tmp_path: Any) -> None:
    need_module("accelerate")
    need_module("transformers")
    results = run_distributed(hugging_face_runs, 2, args=(str(tmp_path),), env=_ENV, timeout=600)
    for rank, result in enumerate(results):
        # Accelerate: instrument(accelerator) before prepare() observes the engine.
        acc = result["accelerate"]
        assert (acc["engine"], acc["monitor"]) == ("DeepSpeedEngine", "DeepSpeedMonitor")
        records = acc["records"]
        assert [r["skipped"] for r in records] == [s == NAN_STEP for s in range(1, STEPS + 1)]
        assert records[0]["setup"] == {"mode": "watch", "policy": "skip", "grad_dtype": "bfloat16"}
        own = [r["step"] for r in records if r["found_inf_origin"]["cpu"]]
        assert own == ([NAN_STEP] if rank == NAN_RANK else [])
        # replica_check_every=1 among instrument()'s options: a check at every step.
        assert [r["replicas"] for r in records] == [AGREE] * STEPS
        # The Trainer: its engine is built in train(); ids from the dataset's column.
        trainer = result["trainer"]
        assert trainer["monitor"] == "DeepSpeedMonitor"
        assert trainer["closed"]
        records = trainer["records"]
        nan_step = next(r["step"] for r in records if NAN_SAMPLE in r["batch"]["ids"])
        assert [r["skipped"] for r in records] == [r["step"] == nan_step for r in records]
        own = [r["step"] for r in records if r["found_inf_origin"]["cpu"]]
        assert own == ([nan_step] if rank == NAN_RANK else [])
        assert [r["replicas"] for r in records] == [AGREE] * len(records)  # fp32 ZeRO-2
        if rank == NAN_RANK:
            names = {p["name"] for p in records[nan_step - 1]["nonfinite_params"]}
            assert names == set(PARAMS)
        # The training logs carry DeepSpeed's skipped steps, as the scalers' do.
        assert trainer["logged"] == [int(r["step"] >= nan_step) for r in records]
