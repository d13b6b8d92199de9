"""The ``rank_failed`` rule: ranks whose training ended on an exception.

A rank ends ``failed`` when its final heartbeat names the exception its training ended on
(``ampscope.reporter.failure``): a ``GradWatch`` that stopped on inf/NaN gradients
(``NonFiniteGradientsError``) above all, or any uncaught exception. The verdict is critical
while the exporter holds such a rank, so a run that failed never reads OK. Pure: O(ranks),
no clock, no I/O; the exporter's health, ``ampscope status``'s merge of several exporters
and its view over Prometheus build the facts, each from what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.ranks import RankRef
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, rule_verdicts

SUMMARY_MESSAGE = 200
"""Characters of the first failure's message the summary quotes (the evidence holds all)."""


@dataclass(frozen=True, kw_only=True)
class FailedFacts(RankRef):
    """What ``rank_failed`` reads of a failed rank."""

    kind: str
    """``nonfinite_gradients`` (a GradWatch stopped training) or ``exception``."""
    exception: str
    """The exception's class name."""
    message: str | None
    """Its message; ``None`` where the source does not hold it (Prometheus)."""
    step: int
    """The step it failed at (a non-finite stop's own step, else the newest reported)."""
    origin_ranks: tuple[int, ...] | None
    """For a non-finite stop, the ranks whose own gradients held inf/NaN, as far as this
    rank knew; ``None`` when not tracked (and for other exceptions)."""


def _quote(message: str | None) -> str:
    if not message:
        return ""
    text = " ".join(message.split())
    return ": " + (text if len(text) <= SUMMARY_MESSAGE else text[: SUMMARY_MESSAGE - 1] + "…")


def rank_failed(failed: Sequence[FailedFacts], ranks: int) -> Verdict:
    """Critical when any rank's training ended on an exception.

    Names the failed ranks and the first failure (lowest step, then rank): its exception and
    step, and, when it stopped on inf/NaN gradients, the origin ranks: the union of what the
    failed ranks at that step name (each names at least its own); else its message.

    Args:
        failed: the failed ranks.
        ranks: how many ranks the run has (held), for the summary.
    """
    say = rule_verdicts("rank_failed")
    if not failed:
        return say("ok", f"no rank of {ranks} failed", {"failed": 0})
    ordered = sorted(failed, key=lambda f: (f.step, f.rank))
    first = ordered[0]
    at_first = [f for f in ordered if f.step == first.step and f.kind == first.kind]
    evidence: dict[str, Any] = {
        "failed": len(ordered),
        "step": first.step,
        "exception": first.exception,
        "kind": first.kind,
        "ranks": [
            {
                **f.ref(),
                "exception": f.exception,
                "kind": f.kind,
                "step": f.step,
                "message": f.message,
            }
            for f in ordered[:MAX_EVIDENCE_RANKS]
        ],
    }
    named = sorted({f.rank for f in ordered})
    shown = ", ".join(map(str, named[:MAX_EVIDENCE_RANKS]))
    more = f" and {len(named) - MAX_EVIDENCE_RANKS} more" if len(named) > MAX_EVIDENCE_RANKS else ""
    summary = f"{len(ordered)} of {ranks} rank(s) failed (rank(s) {shown}{more}): "
    if first.kind == "nonfinite_gradients":
        tracked = [f.origin_ranks for f in at_first if f.origin_ranks is not None]
        origins = sorted({rank for named_ in tracked for rank in named_})
        evidence["origin_tracked"] = bool(tracked)
        evidence["origin_ranks"] = origins[:MAX_EVIDENCE_RANKS]
        if origins:
            origin = "origin rank(s) " + ", ".join(map(str, origins[:MAX_EVIDENCE_RANKS]))
        elif tracked:
            origin = "no rank's own gradients held inf/NaN before the reduction"
        else:
            origin = "origin not tracked (attach(model, track_origin=True) names it)"
        # The message repeats the step and origin; the evidence holds it whole.
        summary += (
            f"training stopped on inf/NaN gradients at step {first.step} "
            f"({first.exception}); {origin}"
        )
    else:
        summary += (
            f"rank {first.rank} (node {first.node}) ended on {first.exception} after step "
            f"{first.step}{_quote(first.message)}"
        )
    return say("critical", summary, evidence)
