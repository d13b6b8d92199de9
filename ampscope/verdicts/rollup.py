"""A run's health from its verdicts and its ranks' states: the roll-up every view shares.

The exporter's ``HealthReport``, ``ampscope status``'s merge of several exporters and its
Prometheus view build their reports here: ``status`` (the worst verdict), ``state``
(``finished`` once every rank finished, ``failed`` once every rank ended and one failed,
``stopped`` once every rank ended, none failed and one was stopped by its launcher)
and ``states`` (ranks per state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ampscope.verdicts.ranks import FINAL_STATES, state_counts
from ampscope.verdicts.verdict import Verdict, worst

RunState = Literal["active", "finished", "failed", "stopped"]
"""A run's state: ``active`` while any rank has not sent its final record; then
``failed`` when one of them ended on an exception, else ``stopped`` when one of them was
stopped by a signal (its launcher stopped it: a preemption, an eviction, an elastic
restart whose next generation has not reported yet), else ``finished`` (as a Kubernetes pod
ends Succeeded or Failed, never both)."""


def run_ended(states: Sequence[str]) -> bool:
    """Whether the run ended: it has ranks, and every one sent its final record (finished,
    failed or stopped)."""
    return bool(states) and all(state in FINAL_STATES for state in states)


def run_state(states: Sequence[str]) -> RunState:
    """The run's state from its ranks' states (one per rank). O(ranks).

    A run stopped by its launcher did not finish: its training did not complete, so it
    never reads ``finished``; nor did it fail, so it never reads ``failed`` (no rank's
    training raised). A rank of the next elastic generation reporting again makes the run
    ``active`` once more.
    """
    if not run_ended(states):
        return "active"
    if "failed" in states:
        return "failed"
    return "stopped" if "stopped" in states else "finished"


def health_report(
    run: str,
    verdicts: Sequence[Verdict] | Sequence[Mapping[str, Any]],
    states: Sequence[str],
    *,
    evaluated_at: float,
    up: int,
) -> dict[str, Any]:
    """The fields of the run's ``HealthReport``, in the JSON API's order, from its verdicts
    (models or their JSON) and its ranks' states (one per rank). O(verdicts + ranks)."""
    statuses = [v.status if isinstance(v, Verdict) else v["status"] for v in verdicts]
    return {
        "run": run,
        "status": worst(statuses),
        "state": run_state(states),
        "evaluated_at": evaluated_at,
        "ranks": len(states),
        "up": up,
        "states": state_counts(states),
        "verdicts": list(verdicts),
    }
