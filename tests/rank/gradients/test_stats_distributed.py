"""The loss and gradient norms on real ranks (gloo): DDP, FSDP2 (scaler and watch) and
FSDP1, one launch. Rank 1 multiplies its inputs at one step; every rank's records must
show the gradient-norm jump, rank 1's own norm must be the outlier, and each rank's own
spike rule must flag what it saw."""

from __future__ import annotations

from typing import Any

import pytest
from stats_setups import BAD_RANK, FAIL_AT, SPIKE, STEPS, stats_worker
from support import run_distributed

pytestmark = pytest.mark.distributed

SETUPS = ("ddp", "fsdp2", "fsdp2_watch", "fsdp2_fp16_reduce", "fsdp1")
OWN_TOLERANCE = {setup: 1e-3 if setup == "fsdp2_fp16_reduce" else 1e-4 for setup in SETUPS}
"""The float16 reduce-scatter sees float16 gradients: three decimal digits."""


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(stats_worker, timeout=150)


@pytest.mark.parametrize("setup", SETUPS)
def test_grad_norm_is_clip_grad_norm_on_every_rank(ranks: list[dict[str, Any]], setup: str) -> None:
    for rank, result in enumerate(ranks):
        assert result[setup]["skipped"] == [False] * STEPS
        norms = [s["grad_norm"] for s in result[setup]["stats"]]
        assert norms == pytest.approx(result[setup]["clip"], rel=1e-5), f"rank {rank}"
    first, second = ([s["grad_norm"] for s in r[setup]["stats"]] for r in ranks)
    assert first == pytest.approx(second, rel=1e-6), "grad_norm differs between ranks"


@pytest.mark.parametrize("setup", SETUPS)
def test_the_spiking_rank_is_the_origin_outlier(ranks: list[dict[str, Any]], setup: str) -> None:
    for rank, result in enumerate(ranks):
        origin = [s["grad_norm_origin"] for s in result[setup]["stats"]]
        # Unscaled, undivided: the rank's own gradient norm, as an unwrapped model says.
        assert origin == pytest.approx(result[setup]["own"], rel=OWN_TOLERANCE[setup]), rank
    bad = ranks[BAD_RANK][setup]["stats"][SPIKE]["grad_norm_origin"]
    good = ranks[1 - BAD_RANK][setup]["stats"][SPIKE]["grad_norm_origin"]
    assert bad > 10 * good
    for step in range(SPIKE):
        ratio = (
            ranks[BAD_RANK][setup]["stats"][step]["grad_norm_origin"]
            / ranks[1 - BAD_RANK][setup]["stats"][step]["grad_norm_origin"]
        )
        assert 0.1 < ratio < 10, f"step {step}: no outlier before the spike"


@pytest.mark.parametrize("setup", SETUPS)
def test_each_rank_flags_its_own_spikes(ranks: list[dict[str, Any]], setup: str) -> None:
    for rank, result in enumerate(ranks):
        stats = result[setup]["stats"]
        flagged = {step: s["spikes"] for step, s in enumerate(stats) if s["spikes"]}
        # grad_norm is the whole job's: every rank sees its jump. The loss is the rank's own.
        expected = ["loss", "grad_norm"] if rank == BAD_RANK else ["grad_norm"]
        assert flagged == {SPIKE: expected}, f"rank {rank}"
        top = stats[SPIKE]["top_params"]
        assert top, f"rank {rank}: a spike names its top parameters"
        assert {p["name"] for p in top} <= set(result[setup]["names"])
        norms = [p["norm"] for p in top]
        assert norms == sorted(norms, reverse=True)
        assert all(s["top_params"] == [] for step, s in enumerate(stats) if step != SPIKE)


def test_a_rank_whose_norms_fail_still_takes_part_in_the_all_reduce(
    ranks: list[dict[str, Any]],
) -> None:
    """FSDP1's norm all-reduce runs on every rank even when one rank's local norms raise
    (a missing collective would hang the others until the deadlock guard): the job's
    norm is unknown (None) at that iteration on every rank, and the failing rank counts
    one telemetry error."""
    for rank, result in enumerate(ranks):
        run = result["fsdp1_failing"]
        norms = [s["grad_norm"] for s in run["stats"]]
        assert norms[FAIL_AT] is None, f"rank {rank}"
        assert all(n is not None for i, n in enumerate(norms) if i != FAIL_AT), f"rank {rank}"
        assert run["errors"] == (1 if rank == BAD_RANK else 0)
        assert run["skipped"] == [False] * STEPS
