"""A run's health from its verdicts and its ranks' states: the roll-up every view shares.

The exporter's ``HealthReport``, ``ampscope status``'s merge of several exporters and its
Prometheus view build their reports here: ``status`` (the worst verdict), ``state``
(``finished`` once every rank finished) and ``states`` (ranks per state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ampscope.verdicts.ranks import state_counts
from ampscope.verdicts.verdict import Verdict, worst

RunState = Literal["active", "finished"]


def run_finished(states: Sequence[str]) -> bool:
    """Whether the run ended normally: it has ranks, and every one sent its final record."""
    return bool(states) and all(state == "finished" for state in states)


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
    state: RunState = "finished" if run_finished(states) else "active"
    return {
        "run": run,
        "status": worst(statuses),
        "state": state,
        "evaluated_at": evaluated_at,
        "ranks": len(states),
        "up": up,
        "states": state_counts(states),
        "verdicts": list(verdicts),
    }
