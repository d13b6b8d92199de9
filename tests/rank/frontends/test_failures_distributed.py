"""ampscope fails inside its capture on one rank of two (gloo): no rank hangs, every rank
makes the same collectives, and training goes on exactly as without ampscope, the failure
counted and logged on the rank where it happened."""

from __future__ import annotations

from typing import Any

import pytest
from failure_setups import FAILING_RANK, INJECT, STEPS, failure_worker
from support import DEADLOCK_GUARD_S, run_distributed

pytestmark = pytest.mark.distributed

LOGGED = "ampscope: telemetry error, training continues (logged once)"


def _launch(scenario: str) -> list[dict[str, Any]]:
    # Deadlock guard: a rank left waiting in a collective the other never makes hangs here.
    return run_distributed(failure_worker, args=(scenario,), timeout=4 * DEADLOCK_GUARD_S)


def _same_collectives_and_counted(ranks: list[dict[str, Any]]) -> None:
    ok, failing = ranks[1 - FAILING_RANK], ranks[FAILING_RANK]
    assert ok["collectives"], "the record of collectives is real"
    assert failing["collectives"] == ok["collectives"]
    assert failing["errors"] >= 1
    assert failing["logged"].count(LOGGED) == 1  # counted each time, logged once
    assert ok["errors"] == 0
    assert LOGGED not in ok["logged"]


@pytest.mark.parametrize("scenario", ["sharded_scaler_fsdp1", "scaler_fsdp2"])
def test_a_scaler_whose_capture_fails_on_one_rank_keeps_the_others_going(scenario: str) -> None:
    ranks = _launch(scenario)
    _same_collectives_and_counted(ranks)
    for rank in ranks:
        assert rank["params_equal"], "training goes on as torch's scaler trains"
        assert rank["scale"] == rank["stock_scale"]
        assert rank["steps"] == list(range(1, STEPS + 1))  # records still made
        # The gradient norm is a sum over both ranks: with one rank unable to take its
        # part, no rank claims one.
        assert rank["grad_norms"] == [None] * STEPS
    assert ranks[0]["run_ids"] == ranks[1]["run_ids"]  # the identity's broadcast paired


def test_a_watch_whose_check_fails_on_one_rank_still_skips_with_the_others() -> None:
    ranks = _launch("watch_skip_fsdp1")
    _same_collectives_and_counted(ranks)
    expected = [step == INJECT for step in range(STEPS)]
    for rank in ranks:
        assert rank["skipped"] == expected
        assert rank["params_equal"]
        assert rank["all_finite"]
        assert rank["steps"] == list(range(1, STEPS + 1))


def test_a_watch_whose_record_fails_on_one_rank_still_stops_every_rank_alike() -> None:
    ranks = _launch("watch_raise_ddp")
    _same_collectives_and_counted(ranks)
    errors = [rank["error"] for rank in ranks]
    assert errors[0] == errors[1]
    assert errors[0]["step"] == INJECT + 1
    assert errors[0]["origin_ranks"] == (FAILING_RANK,)
    assert errors[0]["gathered"] is True
    assert f"Origin rank(s): {FAILING_RANK}." in errors[0]["message"]
    for rank in ranks:
        assert rank["params_equal"]
        assert rank["all_finite"]
    # The failing rank could not record its iterations; the other recorded each.
    assert ranks[FAILING_RANK]["steps"] == []
    assert ranks[1 - FAILING_RANK]["steps"] == list(range(1, INJECT + 2))
