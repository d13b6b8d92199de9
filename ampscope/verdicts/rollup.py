"""A run's health from its verdicts and its ranks' states: the roll-up every view shares.

The exporter's ``HealthReport``, ``ampscope status``'s merge of several exporters and its
Prometheus view build their reports here: ``status`` (the worst verdict), ``state``
(``finished`` once every rank finished, ``failed`` once every rank ended and one failed,
``stopped`` once every rank ended, none failed and one was stopped by its launcher)
and ``states`` (ranks per state).

A run that finished normally reads its spikes as history (``HISTORY_RULES``): a spike warns
of an instability while the run may still go wrong; once every rank ended without a
failure and its training completed (``finished_normally``), it did not, and the run's
``ok`` is what a job's epilogue gates on (``ampscope status`` exits 0). The faults stay:
an applied non-finite update, diverged replicas, a device's transient fault, skipped steps
and a collapsed scale describe what the run's training did, whenever it ended. Whoever
judged a verdict (an exporter that saw only its own ranks, say), the roll-up of the whole
run decides: a history verdict of a run that is not (or no longer) finished normally warns
again (``from_history``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ampscope.verdicts.ranks import FINAL_STATES, state_counts
from ampscope.verdicts.verdict import RuleName, Verdict, worst

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


def finished_normally(states: Sequence[str]) -> bool:
    """Whether the run's training completed: every rank ended, none failed, and one
    finished. Ranks its launcher stopped may be among them: an elastic run that shrank
    leaves its old generation's extra rank ids ``stopped`` (until their retention) while
    the new generation finishes. A run whose every rank was stopped (a preemption) did not
    complete."""
    return run_ended(states) and "failed" not in states and "finished" in states


HISTORY_RULES: tuple[RuleName, ...] = (
    "loss_spike",
    "grad_norm_spike",
    "origin_outlier",
    "fp8_amax_spike",
)
"""Rules that are history once the run finished normally: statistical outliers the run went
on from (a healthy run has some: a heavy-tailed loss, a rank given a short last batch), so
their warning says "look while it may still go wrong". A finished run's are ``ok``, their
summary and evidence kept (``as_history``). A failed run keeps them: they may be what
killed it."""

HISTORY_NOTE = "history, the run finished normally since: "
"""What a history verdict's summary begins with."""


def as_history(verdict: Verdict | Mapping[str, Any]) -> Verdict | Mapping[str, Any]:
    """``verdict`` as the history of a run that finished normally: a ``HISTORY_RULES``
    warning becomes ``ok``, its summary prefixed with ``HISTORY_NOTE`` and its evidence kept
    with ``"history": True``; any other verdict (another rule, an ``ok``) as it is. A model
    stays a model, a JSON verdict (from an exporter) a dict. O(1)."""

    def field(name: str) -> Any:
        return getattr(verdict, name) if isinstance(verdict, Verdict) else verdict.get(name)

    if field("rule") not in HISTORY_RULES or field("status") == "ok":
        return verdict
    summary, evidence = field("summary") or "", field("evidence") or {}
    update = {
        "status": "ok",
        "summary": HISTORY_NOTE + summary,
        "evidence": {**evidence, "history": True, "was": field("status")},
    }
    if isinstance(verdict, Verdict):
        return verdict.model_copy(update=update)
    return {**verdict, **update}


def from_history(verdict: Verdict | Mapping[str, Any]) -> Verdict | Mapping[str, Any]:
    """``verdict`` as it was before ``as_history``: its status (``evidence.was``), summary
    and evidence back; any other verdict as it is. For a run that is not finished normally
    as a whole though an exporter judged its own ranks finished (another node's rank failed
    or still runs). O(1)."""

    def field(name: str) -> Any:
        return getattr(verdict, name) if isinstance(verdict, Verdict) else verdict.get(name)

    evidence = field("evidence") or {}
    if not evidence.get("history") or field("rule") not in HISTORY_RULES:
        return verdict
    summary = field("summary") or ""
    update = {
        # An exporter of this release says what it was; an older one's history warned.
        "status": evidence.get("was") or "warning",
        "summary": summary.removeprefix(HISTORY_NOTE),
        "evidence": {k: v for k, v in evidence.items() if k not in ("history", "was")},
    }
    if isinstance(verdict, Verdict):
        return verdict.model_copy(update=update)
    return {**verdict, **update}


def health_report(
    run: str,
    verdicts: Sequence[Verdict | Mapping[str, Any]],
    states: Sequence[str],
    *,
    evaluated_at: float,
    up: int,
) -> dict[str, Any]:
    """The fields of the run's ``HealthReport``, in the JSON API's order, from its verdicts
    (models or their JSON) and its ranks' states (one per rank); a run that finished
    normally (``finished_normally``) reads the ``HISTORY_RULES``' verdicts as history
    (``as_history``), any other reads them as they were (``from_history``), whoever judged
    them (an exporter, the merge of several, Prometheus). O(verdicts + ranks)."""
    settle = as_history if finished_normally(states) else from_history
    verdicts = [settle(v) for v in verdicts]
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
