"""Running totals: counts that share their dict while nothing changes, never change in
place, and a record's totals becoming the running ones."""

from __future__ import annotations

from ampscope.rank.telemetry.totals import RunningTotals, add_counts, add_flags
from ampscope.reporter.schema import NonfiniteParam


def test_add_flags_keeps_the_dict_while_nothing_counts() -> None:
    counts = {"cuda:0": 2, "cuda:1": 0}
    assert add_flags(counts, {"cuda:0": False, "cuda:1": False}) is counts
    counted = add_flags(counts, {"cuda:0": True, "cuda:1": False})
    assert counted == {"cuda:0": 3, "cuda:1": 0}
    assert counts == {"cuda:0": 2, "cuda:1": 0}  # a record may hold the old one
    # A device seen for the first time is counted from 0, even when clean.
    assert add_flags(counts, {"cuda:2": False}) == {"cuda:0": 2, "cuda:1": 0, "cuda:2": 0}


def test_add_counts_gives_a_new_dict() -> None:
    counts = {"w": 1}
    added = add_counts(counts, {"w": 2, "b": 1})
    assert added == {"w": 3, "b": 1}
    assert counts == {"w": 1}


def test_take_makes_a_records_totals_the_running_ones() -> None:
    totals = RunningTotals()
    top = [NonfiniteParam(name="w", count=5)]
    carried = {
        "steps": 3,
        "skipped_steps": 1,
        "backoffs": 1,
        "growths": 0,
        "found_inf_local": {"cpu": 1},
        "found_inf_origin": {},
        "nonfinite_params": top,
        "min_scale": 4.0,
        "max_scale": 8.0,
        "aligned_scale": None,
        "nonfinite_applied": 0,
        "first_nonfinite_applied": None,
        "faults": {"overflow_at_clean_scale": 1},
        "clean_scale": 8.0,
    }
    totals.take(carried, {"w": 5}, 2)
    assert (totals.steps, totals.skipped_steps, totals.backoffs, totals.growths) == (3, 1, 1, 0)
    assert totals.found_inf_local is carried["found_inf_local"]
    assert (totals.min_scale, totals.max_scale, totals.last_growth_tracker) == (4.0, 8.0, 2)
    assert totals.nonfinite == {"w": 5}
    assert totals.top is top
    assert totals.faults == {"overflow_at_clean_scale": 1}
