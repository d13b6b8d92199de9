"""The process's registry of run ids held by open front-ends: a clash gets the lowest free
``<run>.N``, closing or dropping a front-end frees its id, derived ids stay valid run ids."""

from __future__ import annotations

import gc
import logging

import pytest

from ampscope.rank.telemetry import live_runs
from ampscope.reporter.schema import MAX_LABEL_LENGTH, Identity


class Holder:
    """The one thing the registry reads of a front-end: whether it was closed."""

    def __init__(self) -> None:
        self.closed_already = False
        self.cycle = self  # collected by the cycle collector only, as front-ends are


def _identity(run: str) -> Identity:
    return Identity(run=run, node="n", rank=0, local_rank=0, world_size=1)


def test_a_second_open_holder_gets_the_next_number_and_closing_frees_it() -> None:
    first, second, third = Holder(), Holder(), Holder()
    assert live_runs.claim(first, "lr-a") == "lr-a"
    assert live_runs.claim(second, "lr-a") == "lr-a.2"
    assert live_runs.claim(third, "lr-a") == "lr-a.3"
    second.closed_already = True
    # The lowest free number: a new one takes the closed one's place.
    assert live_runs.claim(Holder(), "lr-a") == "lr-a.2"
    first.closed_already = True
    assert live_runs.claim(Holder(), "lr-a") == "lr-a"  # a retry after close keeps the id


def test_other_run_ids_do_not_clash() -> None:
    first = Holder()
    assert live_runs.claim(first, "lr-b") == "lr-b"
    assert live_runs.claim(Holder(), "lr-c") == "lr-c"


def test_a_dropped_holder_not_yet_collected_frees_its_id() -> None:
    gc.disable()  # the clash itself must collect it, not the collector's own timing
    try:
        dropped = Holder()
        assert live_runs.claim(dropped, "lr-d") == "lr-d"
        del dropped  # in a reference cycle: still alive until a collection
        assert live_runs.claim(Holder(), "lr-d") == "lr-d"
    finally:
        gc.enable()


def test_a_referenced_open_holder_keeps_its_id() -> None:
    kept = Holder()
    assert live_runs.claim(kept, "lr-e") == "lr-e"
    gc.collect()
    assert live_runs.claim(Holder(), "lr-e") == "lr-e.2"
    assert kept.closed_already is False


def test_derived_ids_fit_the_run_id_bounds() -> None:
    longest = "x" * MAX_LABEL_LENGTH
    holders = [Holder() for _ in range(11)]
    runs = [live_runs.claim(h, longest) for h in holders]
    assert runs[0] == longest
    assert runs[1] == "x" * (MAX_LABEL_LENGTH - 2) + ".2"
    assert runs[10] == "x" * (MAX_LABEL_LENGTH - 3) + ".11"
    assert len(set(runs)) == len(runs)
    for run in runs:
        assert _identity(run).run == run  # passes the schema's pattern and length


def test_the_warning_names_both_ids_once(caplog: pytest.LogCaptureFixture) -> None:
    first = Holder()
    live_runs.claim(first, "lr-f")
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        second = Holder()
        assert live_runs.claim(second, "lr-f") == "lr-f.2"
        second.closed_already = True
        assert live_runs.claim(Holder(), "lr-f") == "lr-f.2"
    warnings = [r.getMessage() for r in caplog.records if "reports as run" in r.getMessage()]
    assert len(warnings) == 1
    assert "'lr-f'" in warnings[0]
    assert "'lr-f.2'" in warnings[0]
    assert "run_id=" in warnings[0]
    assert "one scaler" in warnings[0]
