"""What a verdict is: its statuses and their order, the rules in report order, and the model.

The one definition of each, read by every rule, by the exporter's health, by ``ampscope
status`` (its merge, its Prometheus view and its exit status) and by the JSON API's schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

from pydantic import BaseModel

from ampscope.verdicts.thresholds import Thresholds

Status = Literal["ok", "warning", "critical"]
"""A verdict's or a run's health, mildest first."""

STATUSES: tuple[Status, ...] = get_args(Status)
SEVERITY: dict[str, int] = {status: order for order, status in enumerate(STATUSES)}
"""Status -> its order (0 ok, 1 warning, 2 critical): also ``ampscope status``'s exit status."""

RuleName = Literal[
    "scale_collapse",
    "skip_storm",
    "scale_desync",
    "lost_rank",
    "missing_rank",
    "stalled_rank",
    "stopped_rank",
    "rank_failed",
    "inf_hotspot",
    "nonfinite_update_applied",
    "nonfinite_skipped",
    "loss_spike",
    "grad_norm_spike",
    "origin_outlier",
    "transient_fault",
    "reproducible_fault",
    "replica_divergence",
    "fp8_amax_spike",
    "fp8_underflow",
    "fp8_nonfinite_amax",
]
"""Every rule, in the order a health report lists them."""

RULES: tuple[RuleName, ...] = get_args(RuleName)
"""The rules in report order: a new rule is one entry in ``RuleName``."""

FP8_RULES: tuple[RuleName, ...] = ("fp8_amax_spike", "fp8_underflow", "fp8_nonfinite_amax")
"""The rules over FP8 layers' series (``ampscope.verdicts.fp8``): a run without FP8 layers
does not report them."""

MAX_EVIDENCE_RANKS = 16
"""Ranks listed in one verdict's evidence at most (the count is always given)."""


class Verdict(BaseModel):
    """One health rule's result, with the numbers behind it."""

    rule: RuleName
    status: Status
    summary: str
    evidence: dict[str, Any]
    thresholds: dict[str, float | int]


def affected(ranks: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    """A verdict's evidence over the ranks it names: how many, ``more``, and the first
    ``MAX_EVIDENCE_RANKS`` of them."""
    return {"ranks_affected": len(ranks), **more, "ranks": ranks[:MAX_EVIDENCE_RANKS]}


Say = Callable[[Status, str, dict[str, Any]], Verdict]
"""``say(status, summary, evidence)``: one rule's verdict."""


def rule_verdicts(rule: RuleName, t: Thresholds | None = None) -> Say:
    """How ``rule`` states its verdicts: ``say(status, summary, evidence)``, with the rule's
    name and the thresholds it judged with (those ``REPORTED`` lists for it) filled in."""
    judged = {} if t is None else t.reported(rule)

    def say(status: Status, summary: str, evidence: dict[str, Any]) -> Verdict:
        return Verdict(
            rule=rule, status=status, summary=summary, evidence=evidence, thresholds=judged
        )

    return say


def worst(statuses: Iterable[str]) -> Status:
    """The most severe of ``statuses`` (``ok`` when there are none). O(len(statuses))."""
    return STATUSES[max((SEVERITY[status] for status in statuses), default=0)]


def in_report_order(names: Iterable[str]) -> list[str]:
    """``names`` in ``RULES``' order, any rule this version does not know (a newer exporter's)
    after them in the order given."""
    given = list(dict.fromkeys(names))
    return [r for r in RULES if r in given] + [n for n in given if n not in RULES]
