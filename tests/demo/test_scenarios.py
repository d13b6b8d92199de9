"""Scenario definitions: when outliers, corruption and the stale restore happen."""

from __future__ import annotations

import pytest

from ampscope.demo.scenarios import SCENARIOS, Scenario
from ampscope.demo.session import MIN_STEPS
from ampscope.reporter.spike_rule import SpikeRule


def test_the_default_mix_provokes_every_instability_verdict() -> None:
    expected = {rule for scenario in SCENARIOS.values() for rule in scenario.expect}
    # lost_rank and stalled_rank need ranks that die or hang: the demo's ranks finish
    # (tests/integration/test_run_lifecycle.py provokes both with real processes).
    assert expected == {
        "inf_hotspot",
        "scale_collapse",
        "skip_storm",
        "scale_desync",
        "loss_spike",
        "grad_norm_spike",
        "origin_outlier",
        "reproducible_fault",
        "transient_fault",
    }
    assert list(SCENARIOS) == ["overflow", "hotspot", "collapse", "desync", "spike", "rerun"]


def test_outliers_only_on_the_chosen_rank_and_period() -> None:
    hotspot = SCENARIOS["hotspot"]
    hits = [
        (rank, step)
        for rank in range(4)
        for step in range(1, 61)
        if hotspot.outliers_at(step, rank, 4)
    ]
    # -1: the last rank; its six outlier batches, then none.
    assert hits == [(3, 5), (3, 10), (3, 15), (3, 20), (3, 25), (3, 30)]
    assert not SCENARIOS["overflow"].outliers_at(5, 1, 2)


def test_corruption_starts_after_its_fraction_of_the_run() -> None:
    collapse = SCENARIOS["collapse"]
    corrupt = [step for step in range(1, 31) if collapse.corrupt_at(step, 30)]
    assert corrupt == list(range(16, 31))
    assert not SCENARIOS["desync"].corrupt_at(30, 30)


def test_stale_restore_step() -> None:
    assert SCENARIOS["desync"].restore_step(60) == 24
    assert SCENARIOS["desync"].restore_step(5) == 2  # never step 1, when the state is saved
    assert SCENARIOS["hotspot"].restore_step(60) is None


def test_the_bad_batch_follows_a_full_spike_window_even_in_the_shortest_run() -> None:
    spike = SCENARIOS["spike"]
    assert spike.bad_batch_step(60) == 46
    assert spike.bad_batch_step(MIN_STEPS) == 23
    # Nothing else in the run overflows (no outliers, no corruption, no growth within the
    # demo), so every iteration before the bad batch joins the rule's window.
    assert spike.bad_batch_step(MIN_STEPS) - 1 >= SpikeRule().min_window
    assert spike.growth_interval > 60
    assert spike.outlier_rank is None
    assert spike.corrupt_from is None
    assert SCENARIOS["hotspot"].bad_batch_step(60) is None


def test_the_rerun_run_plants_its_two_faults_on_separate_steps() -> None:
    rerun = SCENARIOS["rerun"]
    assert rerun.rerun
    assert (rerun.nan_sample_step(60), rerun.transient_fault_step(60)) == (19, 37)
    assert (rerun.nan_sample_step(MIN_STEPS), rerun.transient_fault_step(MIN_STEPS)) == (10, 19)
    # Only these two iterations are flagged: no outliers, no corruption, a scale too low to
    # overflow that never grows within the demo.
    assert rerun.init_scale == SCENARIOS["spike"].init_scale
    assert rerun.growth_interval > 60
    assert rerun.outlier_rank is None
    assert rerun.corrupt_from is None
    assert rerun.bad_batch_at is None
    assert rerun.stale_restore_at is None
    # The other runs pass no closure: their flagged iterations are not rerun.
    assert [name for name, s in SCENARIOS.items() if s.rerun] == ["rerun"]
    assert SCENARIOS["spike"].nan_sample_step(60) is None
    assert SCENARIOS["spike"].transient_fault_step(60) is None


def test_sample_ids_deal_one_stream_to_the_ranks() -> None:
    from ampscope.demo.trainer import BATCH, NAN_SAMPLE, sample_ids

    dealt = [i for step in (1, 2) for rank in (0, 1) for i in sample_ids(step, rank, 2)]
    assert dealt == list(range(4 * BATCH))
    assert sample_ids(10, 1, 2)[NAN_SAMPLE] == (9 * 2 + 1) * BATCH + NAN_SAMPLE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"outlier_rank": 1}, "outlier_every"),
        ({"corrupt_from": 1.0}, "corrupt_from"),
        ({"stale_restore_at": 0.0}, "stale_restore_at"),
        ({"bad_batch_at": 1.5, "bad_batch_factor": 20.0}, "bad_batch_at"),
        ({"bad_batch_at": 0.5}, "bad_batch_factor"),
        ({"bad_batch_at": 0.5, "bad_batch_factor": float("nan")}, "bad_batch_factor"),
        ({"nan_sample_at": 0.3}, "need rerun"),
        ({"transient_fault_at": 0.3}, "need rerun"),
        ({"rerun": True, "nan_sample_at": 0.5, "transient_fault_at": 0.5}, "must differ"),
        ({"rerun": True, "transient_fault_at": 1.0}, "transient_fault_at"),
    ],
)
def test_invalid_scenarios_are_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Scenario(name="bad", story="", expect=(), **kwargs)  # type: ignore[arg-type]
