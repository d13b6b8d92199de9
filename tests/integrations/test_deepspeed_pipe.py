"""``instrument`` on DeepSpeed's ``PipelineEngine`` (``train_batch()``), with the real
DeepSpeed on 2 gloo ranks in one launch (:mod:`deepspeed_pipe_workers`): 2 pipeline stages,
and 1 stage x 2 data-parallel ranks; and the refusal where a release moved the optimizer
step ampscope wraps (without DeepSpeed)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from deepspeed_pipe_workers import (
    ALL_PARAMS,
    NAN_RANK,
    NAN_STEP,
    STAGE_PARAMS,
    STEPS,
    TIED_WEIGHT,
    pipelines,
)
from deepspeed_workers import AGREE
from support import get_json, need_module, run_distributed
from torch import nn

from ampscope.integrations.deepspeed import instrument, make_monitor

_SETUP = {"mode": "watch", "policy": "skip", "grad_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def results(exporter: Any) -> list[dict[str, Any]]:
    need_module("deepspeed")
    env = {"DS_ACCELERATOR": "cpu", "AMPSCOPE_URL": exporter.url}
    return run_distributed(pipelines, 2, env=env, timeout=600)


def _as_deepspeed(result: dict[str, Any]) -> None:
    """One record per ``train_batch()``; its skip, overflow and norm are DeepSpeed's."""
    records, seen = result["records"], result["seen"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in records] == [not s["applied"] for s in seen]
    assert [r["found_inf_global"] for r in records] == [s["overflow"] for s in seen]
    assert [r["stats"]["grad_norm"] for r in records] == [
        None if s["overflow"] else s["norm"] for s in seen
    ]
    assert records[-1]["totals"]["skipped_steps"] == seen[-1]["skipped_steps"]


@pytest.mark.distributed
def test_two_stages_record_every_step(results: list[dict[str, Any]], report_to: str) -> None:
    for rank, result in enumerate(results):
        ours = result["ours"]
        # Each rank is a stage; its data-parallel group (the replica check's) is the grid's.
        assert (ours["stage"], ours["params"]) == (rank, list(STAGE_PARAMS[rank]))
        assert ours["group"] == ours["grid_group"] == [rank]
        assert ours["optimizer"] == "DeepSpeedZeroOptimizer"  # bf16 at ZeRO-1
        assert ours["weights"] == result["plain"]["weights"]  # observe-only, bit for bit
        _as_deepspeed(ours)
        records = ours["records"]
        assert [r["skipped"] for r in records] == [s == NAN_STEP for s in range(1, STEPS + 1)]
        for record, seen in zip(records, ours["seen"], strict=True):
            step = record["step"]
            assert record["setup"] == _SETUP
            assert record["batch"]["ids"] == [f"r{rank}s{step}"]
            assert record["replicas"] is None  # one rank per stage: no replica
            # The origin: this stage's own parameters, at the NaN step only.
            assert record["found_inf_origin"] == {"cpu": step == NAN_STEP}
            names = {p["name"] for p in record["nonfinite_params"]}
            assert names == (set(STAGE_PARAMS[rank]) if step == NAN_STEP else set())
            # The loss: the last stage's (DeepSpeed's mean of the batch), not the first's.
            loss = record["stats"]["loss"]
            if rank == 1 and step != NAN_STEP:
                assert loss == pytest.approx(seen["loss"], rel=1e-6)
            else:
                assert loss is None
    verdicts = {
        v["rule"]: v for v in get_json(f"{report_to}/api/v1/runs/ds-pipe-nan/health")["verdicts"]
    }
    skipped = verdicts["nonfinite_skipped"]
    assert skipped["status"] == "warning", skipped
    assert skipped["evidence"]["origin_ranks"] == [0, 1]
    assert skipped["evidence"]["last_step"] == NAN_STEP


@pytest.mark.distributed
def test_a_clean_pipeline_is_healthy(results: list[dict[str, Any]], report_to: str) -> None:
    for result in results:
        records = result["clean"]["records"]
        _as_deepspeed(result["clean"])
        assert not any(r["skipped"] or r["found_inf_origin"]["cpu"] for r in records)
    health = get_json(f"{report_to}/api/v1/runs/ds-pipe-clean/health")
    assert health["status"] == "ok", health


@pytest.mark.distributed
def test_data_parallel_stage_compares_its_replicas(results: list[dict[str, Any]]) -> None:
    losses = []
    for rank, result in enumerate(results):
        data = result["data"]
        assert (data["stage"], data["params"]) == (0, list(ALL_PARAMS))
        assert data["group"] == data["grid_group"] == [0, 1]
        _as_deepspeed(data)
        records = data["records"]
        assert [r["replicas"] for r in records] == [AGREE] * STEPS
        own = [r["step"] for r in records if r["found_inf_origin"]["cpu"]]
        assert own == ([NAN_STEP] if rank == NAN_RANK else [])
        losses.append([r["stats"]["loss"] for r in records])
    # Each rank's own loss; DeepSpeed's is their mean over the data-parallel group.
    for step, seen in enumerate(results[0]["data"]["seen"]):
        if step + 1 != NAN_STEP:
            assert (losses[0][step] + losses[1][step]) / 2 == pytest.approx(seen["loss"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("key", "optimizer"),
    [
        ("bf16z0", "BF16_Optimizer"),
        ("fp16z0", "FP16_UnfusedOptimizer"),
        ("fp16z1", "DeepSpeedZeroOptimizer"),
    ],
)
def test_two_stages_at_zero_0_and_in_fp16(
    results: list[dict[str, Any]], key: str, optimizer: str
) -> None:
    fp16 = key.startswith("fp16")
    for rank, result in enumerate(results):
        ours = result[key]
        assert ours["optimizer"] == optimizer
        _as_deepspeed(ours)
        records, seen = ours["records"], ours["seen"]
        assert records[NAN_STEP - 1]["skipped"]
        # The origin: what this stage's own gradients held right before train_batch()
        # reduced them (summed over the micro-batches: in fp16 a sum of finite gradients
        # can overflow there). BF16_Optimizer reduces elsewhere: each micro-batch's own.
        truth = ours["truth"] if key != "bf16z0" else None
        if truth is not None:
            assert len(truth) == STEPS
            assert truth[NAN_STEP - 1] == list(STAGE_PARAMS[rank])
        for record in records:
            assert record["setup"]["mode"] == ("scaler" if fp16 else "watch")
            names = {p["name"] for p in record["nonfinite_params"]}
            step = record["step"]
            if truth is None:
                assert names == (set(STAGE_PARAMS[rank]) if step == NAN_STEP else set())
            else:
                assert names == set(truth[step - 1]), (rank, step)
                assert record["found_inf_origin"] == {"cpu": bool(truth[step - 1])}
            assert (record["stats"]["loss"] is None) == (rank == 0 or record["skipped"])
        # fp16: the scale DeepSpeed's loss scaler held before and after each step.
        after = [s["scale"] for s in seen] if fp16 else [None] * STEPS
        assert [r["scale_after"] for r in records] == (after if fp16 else [1.0] * STEPS)
        if fp16:
            assert [r["scale_before"] for r in records][1:] == after[:-1]
            assert any(r["event"] == "backoff" for r in records)


@pytest.mark.distributed
def test_tied_weights_name_only_the_stage_whose_own_gradient_held_the_nan(
    results: list[dict[str, Any]],
) -> None:
    """A weight tied across the 2 stages, NaN in the first stage's own gradient of it only:
    ``train_batch()`` all-reduces tied gradients across the stages before its data-parallel
    reduction, so only the first stage's record names it; both stages skip."""
    by_stage = {result["tied"]["stage"]: result["tied"]["records"] for result in results}
    for stage, records in by_stage.items():
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert [r["skipped"] for r in records] == [s == NAN_STEP for s in range(1, STEPS + 1)]
        for record in records:
            own = stage == 0 and record["step"] == NAN_STEP
            assert record["found_inf_origin"] == {"cpu": own}, (stage, record["step"])
            names = [p["name"] for p in record["nonfinite_params"]]
            assert names == ([TIED_WEIGHT] if own else []), (stage, record["step"])


class PipelineEngine(nn.Module):
    """Named as DeepSpeed's, of a release without the optimizer step ampscope wraps."""

    def was_step_applied(self) -> bool:
        return True

    def is_gradient_accumulation_boundary(self) -> bool:
        return False

    def backward(self, *args: Any) -> None:
        raise AssertionError("disabled in pipeline mode")

    def step(self, *args: Any) -> None:
        raise AssertionError("disabled in pipeline mode")


def test_a_pipeline_engine_without_its_step_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    engine = PipelineEngine()
    with pytest.raises(NotImplementedError, match=r"PipelineEngine.*_take_model_step"):
        instrument(engine, reporter=None)
    assert "step" not in vars(engine)  # nothing wrapped, nothing hooked
    assert not hasattr(engine, "_ampscope_monitor")
    # The Trainer's and Accelerate's path: logged once, training goes on unobserved.
    monitor = make_monitor(None, {"reporter": None})
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        monitor.attach(engine)
        monitor.attach(engine)
    refusals = [r for r in caplog.records if "PipelineEngine" in r.getMessage()]
    assert len(refusals) == 1
    assert monitor.engine is None
    monitor.close()
