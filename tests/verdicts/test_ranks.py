"""Rank states and "is this rank a scaler", as the exporter and every status view read them."""

from __future__ import annotations

from ampscope.verdicts.ranks import STATES, is_scaler, mode_of, reported_state, state_counts


def test_states_are_listed_in_one_order_with_every_state_counted() -> None:
    assert STATES == ("running", "stalled", "lost", "finished", "failed", "stopped")
    assert state_counts(["lost", "running", "lost"]) == {
        "running": 1,
        "stalled": 0,
        "lost": 2,
        "finished": 0,
        "failed": 0,
        "stopped": 0,
    }


def test_an_older_exporters_rank_reads_running_or_lost() -> None:
    # Exporters before the states said only whether a rank was up.
    assert reported_state(None, True) == "running"
    assert reported_state(None, False) == "lost"
    assert reported_state("", None) == "lost"
    assert reported_state("stalled", True) == "stalled"
    # A newer exporter's state is kept as given: the tables show it, no rule counts it.
    assert reported_state("hibernating", False) == "hibernating"


def test_a_rank_without_a_setup_is_a_scaler() -> None:
    assert is_scaler("scaler")
    assert not is_scaler("watch")
    assert is_scaler(mode_of({"rank": 0}))  # reporters and exporters before the field
    assert not is_scaler(mode_of({"setup": {"mode": "watch", "policy": "skip"}}))
    assert is_scaler(mode_of({"setup": None}))
