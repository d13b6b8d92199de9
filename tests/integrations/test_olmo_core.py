"""``ampscope.integrations.olmo_core.AmpscopeCallback`` with the real, unpatched OLMo-core."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
from checks import check_failed_with, exporter_ranks, ranks_read
from olmo_core_workers import (
    INJECT_RANK,
    INJECT_STEP,
    STEPS,
    bad_batch_worker,
    olmo_worker,
    skip_step_worker,
)
from support import need_module, run_distributed

need_module("olmo_core")

TIMEOUT_S = 600.0
"""Deadlock guard for one distributed test (four OLMo-core runs per rank on two cores)."""


NAN_PARAMS = ["embeddings.weight"]


def _at_inject() -> list[bool]:
    return [step == INJECT_STEP for step in range(1, STEPS + 1)]


def _metric(run: dict[str, Any], name: str) -> list[float]:
    return [run["metrics"][step][name] for step in range(1, STEPS + 1)]


def _check_observe(stock: dict[str, Any], observe: dict[str, Any], world_size: int = 1) -> None:
    assert stock["error"] is None
    assert observe["error"] is None
    assert observe["bits"] == stock["bits"]  # bit for bit, bf16 parameters
    assert stock["optimizer_steps"] == observe["optimizer_steps"] == [STEPS]
    # Several ranks: origin tracked, over the data-parallel group of all of them.
    group = {"origin_group": {"first": 0, "size": world_size}} if world_size > 1 else {}
    assert observe["setup"] == {
        "mode": "watch",
        "policy": "observe",
        "grad_dtype": "float32",
        **group,
    }
    assert observe["skipped"] == observe["found"] == observe["origin"] == [False] * STEPS
    # The norm of the gradients before OLMo-core clipped them: its own "total grad norm".
    logged = _metric(observe, "optim/total grad norm")
    assert logged == _metric(stock, "optim/total grad norm")
    pairs = zip(observe["grad_norm"], logged, strict=True)
    assert all(math.isclose(ours, theirs, rel_tol=1e-3) for ours, theirs in pairs)
    assert all(norm > 0 for norm in logged)
    assert observe["closed"]
    assert observe["step_is_class_method"]
    assert observe["clip_restored"]
    _check_norms(observe)


def _check_norms(run: dict[str, Any]) -> None:
    """OLMo-core's clip gives the norms, in the model's order: the local (shard) norms of
    the gradients it clips, NaN included; the watch makes no pass of its own, not even in
    the first iteration."""
    assert run["norm_names"] == run["param_names"]
    assert run["norms_as_seen"]
    assert run["own_norm_passes"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_olmo_core_two_ranks(report_to: str, tmp_path: Path) -> None:
    results = run_distributed(olmo_worker, 2, args=("olmo", str(tmp_path)), timeout=TIMEOUT_S)
    for result in results:
        _check_observe(result["stock"], result["observe"], world_size=2)
    # Each rank's record holds its own CE loss; OLMo-core logs their mean.
    logged_loss = _metric(results[0]["observe"], "train/CE loss")
    per_rank = zip(*(r["observe"]["loss"] for r in results), strict=True)
    mean_loss = [sum(pair) / 2 for pair in per_rank]
    pairs = zip(mean_loss, logged_loss, strict=True)
    assert all(math.isclose(ours, theirs, rel_tol=1e-5) for ours, theirs in pairs)
    assert results[0]["observe"]["loss"] != results[1]["observe"]["loss"]

    for rank, result in enumerate(results):
        stock, skip, stop = result["stock"], result["skip"], result["raise"]
        # skip: the poisoned step skipped on both ranks, training finished, finite.
        assert skip["error"] is None
        assert skip["finite"]
        assert skip["skipped"] == skip["found"] == _at_inject()
        assert skip["origin"] == (_at_inject() if rank == INJECT_RANK else [False] * STEPS)
        assert skip["skipped_steps"] == 1
        assert skip["optimizer_steps"] == [STEPS - 1]
        assert _metric(skip, "optim/step skipped") == [float(s) for s in _at_inject()]
        # The step-indexed schedule held: each step after the skip got the learning rate
        # of the step before it in the run without a skip.
        lr, stock_lr = _metric(skip, "optim/LR (group 0)"), _metric(stock, "optim/LR (group 0)")
        assert lr[:INJECT_STEP] == stock_lr[:INJECT_STEP]
        assert lr[INJECT_STEP:] == stock_lr[INJECT_STEP - 1 : -1]
        assert skip["scheduler_restored"]
        assert skip["step_is_class_method"]
        assert skip["closed"]
        # The NaN step still names what held it (the NaN enters the embedding's output
        # gradient: its weight's is the one it reaches).
        assert skip["nonfinite"] == [NAN_PARAMS if at else [] for at in _at_inject()]
        _check_norms(skip)
        # raise: both ranks stop at the poisoned step with the same words.
        assert stop["error"] is not None
        assert stop["error"].startswith("NonFiniteGradientsError: ")
        assert f"at step {INJECT_STEP}" in stop["error"]
        assert f"Origin rank(s): {INJECT_RANK}." in stop["error"]
        assert stop["optimizer_steps"] == [INJECT_STEP - 1]
        assert stop["closed"]
        assert stop["clip_restored"]  # its fit ended in the exception
        assert skip["clip_restored"]
    assert results[0]["raise"]["error"] == results[1]["raise"]["error"]

    # The exporter names the origin rank of the skipped step.
    ranks = exporter_ranks(report_to, "olmo-skip", 2, steps=STEPS)
    for rank, view in enumerate(ranks):
        assert view["totals"]["skipped_steps"] == 1
        origin = sum(view["totals"]["found_inf_origin"].values())
        assert origin == (1 if rank == INJECT_RANK else 0)


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_olmo_core_skip_step_optimizer(tmp_path: Path) -> None:
    """OLMo-core's SkipStepAdamW "skips" by multiplying its update by 0, which keeps a NaN
    gradient's NaN: without ampscope the run dies. With ``skip`` ampscope does not call
    its step, and keeps the step out of its rolling window, so it skips only once."""
    results = run_distributed(
        skip_step_worker, 2, args=("olmo-skipstep", str(tmp_path)), timeout=TIMEOUT_S
    )
    for result in results:
        stock, skip = result["stock"], result["skip"]
        assert stock["error"] is not None
        assert "RuntimeError" in stock["error"]
        assert not stock["finite"]
        assert stock["metrics"][INJECT_STEP]["optim/step skipped"] == 1.0
        assert skip["error"] is None
        assert skip["finite"]
        assert skip["skipped"] == _at_inject()
        assert _metric(skip, "optim/step skipped") == [float(s) for s in _at_inject()]
        assert skip["optimizer_steps"] == [STEPS - 1]
        assert skip["forward_restored"]
    # Without ampscope OLMo-core's NaN-loss check ended the run at the same step on both
    # ranks, though rank INJECT_RANK checked its metrics a step late (check_metrics_late).
    assert results[0]["stock"]["left_at_step"] == results[1]["stock"]["left_at_step"]
    # Each rank's record holds its own CE loss, read before the SkipStepOptimizer's
    # all-reduce (in place, in train_batch): the ranks' losses differ, and their mean is
    # what OLMo-core logs.
    losses = [r["skip"]["loss"] for r in results]
    assert losses[0] != losses[1]
    logged = _metric(results[0]["skip"], "train/CE loss")
    # The skipped step's record holds no loss (its statistics are not kept).
    compared = [
        (pair, theirs)
        for pair, theirs in zip(zip(*losses, strict=True), logged, strict=True)
        if None not in pair
    ]
    assert len(compared) == STEPS - 1
    for (rank0, rank1), theirs in compared:
        assert rank0 != rank1
        assert math.isclose((rank0 + rank1) / 2, theirs, rel_tol=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_olmo_core_fit_that_raises_ends_the_rank_failed(report_to: str, tmp_path: Path) -> None:
    # A data error out of fit(), caught by the caller: OLMo-core calls on_error, then
    # close; the rank ends failed with the exception, not finished (a missed fault).
    [result] = run_distributed(
        bad_batch_worker, 1, args=("olmo-bad", str(tmp_path)), timeout=TIMEOUT_S
    )
    assert result["error"] == "RuntimeError: a bad batch"
    assert result["closed"]
    [view] = ranks_read(report_to, "olmo-bad-observe", "failed")
    check_failed_with(view, "RuntimeError", "a bad batch")
    assert view["step"] == INJECT_STEP - 1


def test_options_are_checked_where_given() -> None:
    from ampscope.integrations.olmo_core import AmpscopeCallback

    with pytest.raises(ValueError, match="policy"):
        AmpscopeCallback(policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AmpscopeCallback(init_scale=2.0)


def test_survives_with_callback_deep_copies() -> None:
    """``TrainerConfig.with_callback()`` deep-copies the callbacks added before."""
    from olmo_core.train.callbacks import Callback

    from ampscope.integrations.olmo_core import AmpscopeCallback

    callback = AmpscopeCallback(policy="skip", max_consecutive_skips=2, reporter=None)
    assert isinstance(callback, Callback)
    clone = copy.deepcopy({"ampscope": callback})["ampscope"]
    assert clone is not callback
    assert clone.watch is None
    assert clone.skipped_steps == 0
    assert clone._config == callback._config
