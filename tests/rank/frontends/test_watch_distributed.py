"""A GradWatch on real ranks (gloo): DDP (float32 and bf16), FSDP1, FSDP2 on a 1-D mesh
(float32, and bf16 compute with a bf16 reduce-scatter) and FSDP2 with tensor parallelism on
a 2-D mesh, each under observe, skip and raise, in one launch."""

from __future__ import annotations

from typing import Any

import pytest
from support import run_distributed
from watch_setups import BAD_RANK, INJECT, STEPS, watch_worker

pytestmark = pytest.mark.distributed

SETUPS = ("ddp", "ddp_bf16", "fsdp1", "fsdp2", "fsdp2_bf16_reduce", "tp")
TRACKED = {setup: setup != "tp" for setup in SETUPS}
"""Setups with origin tracking; the 2-D mesh's single replica runs no gradient collective."""
GRAD_DTYPE = {setup: "bfloat16" if setup == "ddp_bf16" else "float32" for setup in SETUPS}
"""FSDP2 in bf16 computes and reduces in bf16 but keeps float32 sharded gradients."""
STATS_ALL_REDUCES = {setup: 1 if setup == "fsdp1" else 0 for setup in SETUPS}
"""All-reduces per iteration of the gradient norm (stats): FSDP1's flat gradient shards sum
their squared norm over the group with ``dist.all_reduce``. (FSDP2's DTensor shards do it
through DTensor's functional collectives, which the counter does not wrap; DDP's
gradients are whole.)"""


def _with_stats(counts: dict[str, int], setup: str, iterations: int) -> dict[str, int]:
    """``counts`` plus the stats' all-reduces of ``iterations`` iterations."""
    extra = STATS_ALL_REDUCES[setup] * iterations
    if not extra:
        return counts
    return {**counts, "all_reduce": counts.get("all_reduce", 0) + extra}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    # Deadlock guard only: a rank that waits for a peer that raised would hang here.
    return run_distributed(watch_worker, timeout=120)


@pytest.mark.parametrize("setup", SETUPS)
def test_observe_is_bit_identical_without_a_collective(
    ranks: list[dict[str, Any]], setup: str
) -> None:
    for rank, result in enumerate(ranks):
        observe = result[setup]["observe"]
        assert observe["bit_identical"], f"rank {rank}"
        assert observe["nonfinite_params"], "the non-finite update must have been applied"
        assert observe["collectives"] == _with_stats({}, setup, STEPS), (
            f"rank {rank}: observe issued collectives beyond the gradient norm's"
        )
        assert observe["skipped"] == [False] * STEPS
        records = observe["records"]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        # From the injection on, the weights hold NaN: every later iteration found inf.
        assert all(r["found_inf_global"] for r in records[INJECT + 1 :])
        applied = records[-1]["totals"]["first_nonfinite_applied"]
        first = next(i for i, r in enumerate(records) if r["found_inf_global"])
        assert applied["step"] == first + 1
        assert records[-1]["totals"]["nonfinite_applied"] == STEPS - first
        # With origin tracking the setup names the data-parallel group: both ranks.
        assert records[-1]["setup"] == {
            "mode": "watch",
            "policy": "observe",
            "grad_dtype": GRAD_DTYPE[setup],
            **({"origin_group": {"first": 0, "size": 2}} if TRACKED[setup] else {}),
        }
        if TRACKED[setup]:
            # The reduction spreads rank 1's inf to every rank's gradients in that step;
            # the origin says whose own gradients held it.
            assert first == INJECT
            assert applied["origin"] == (rank == BAD_RANK)
            assert records[INJECT]["found_inf_origin"] == {"cpu": rank == BAD_RANK}
        else:
            # Rank 1's NaN sits in its own shard; rank 0's turn NaN one step later.
            assert first == (INJECT if rank == BAD_RANK else INJECT + 1)
            assert applied["origin"] is None


@pytest.mark.parametrize("setup", SETUPS)
def test_skip_matches_a_run_without_that_step_on_every_rank(
    ranks: list[dict[str, Any]], setup: str
) -> None:
    expected = [step == INJECT for step in range(STEPS)]
    for rank, result in enumerate(ranks):
        skip = result[setup]["skip"]
        assert skip["equal_reference"], f"rank {rank}"
        assert skip["all_finite"]
        assert skip["skipped"] == expected
        assert [r["skipped"] for r in skip["records"]] == expected
        assert [r["found_inf_global"] for r in skip["records"]] == expected
        assert skip["collectives"] == _with_stats({"all_reduce": STEPS}, setup, STEPS), (
            "one agreement per iteration"
        )
        local = skip["records"][INJECT]["found_inf_local"]["cpu"]
        origin = skip["records"][INJECT]["found_inf_origin"]
        if TRACKED[setup]:
            assert origin == {"cpu": rank == BAD_RANK}
        else:
            assert origin == {}
            assert local == (rank == BAD_RANK)  # the NaN sits in rank 1's shard only


@pytest.mark.parametrize("setup", SETUPS)
def test_raise_stops_every_rank_with_the_same_words(
    ranks: list[dict[str, Any]], setup: str
) -> None:
    errors = [result[setup]["raise"].get("error") for result in ranks]
    assert all(errors), "every rank must raise"
    assert errors[0] == errors[1]
    error = errors[0]
    assert error["step"] == INJECT + 1
    assert error["origin_ranks"] == ((BAD_RANK,) if TRACKED[setup] else None)
    assert f"step {INJECT + 1}" in error["message"]
    if TRACKED[setup]:
        assert f"Origin rank(s): {BAD_RANK}." in error["message"]
    assert "0.weight" in error["message"]
    for result in ranks:
        stopped = result[setup]["raise"]
        assert stopped["all_finite"], "the non-finite update was applied"
        assert [r["step"] for r in stopped["records"]] == list(range(1, INJECT + 2))
        assert stopped["records"][-1]["found_inf_global"]
        assert stopped["collectives"] == _with_stats(
            # The gather: the reports' sizes, then their bytes (no NumPy needed).
            {"all_reduce": INJECT + 1, "all_gather": 2},
            setup,
            INJECT + 1,
        )
