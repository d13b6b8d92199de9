"""Running totals: counts that share their dict while nothing changes, never change in
place, and a record's totals becoming the running ones."""

from __future__ import annotations

import dataclasses

from ampscope.rank.telemetry.totals import RunningTotals, add_counts, add_flags


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


def test_take_sets_every_field_in_the_fields_order() -> None:
    totals = RunningTotals()
    moved = tuple(range(len(dataclasses.fields(RunningTotals))))
    totals.take(moved)
    assert dataclasses.astuple(totals) == moved
