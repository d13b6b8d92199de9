"""The rerun rules over a neutral view of each rank's reruns (``RerunFacts``):
``transient_fault`` and ``reproducible_fault``.

A rank runs ``step(optimizer, rerun=closure)``; when an iteration is flagged, every rank
reruns it and compares its own two results. A result the rerun did not reproduce points at
the rank's device (critical); one it reproduced points at the data or the numerics
(warning). Only ranks whose own result was flagged take part. The exporter's health feeds
the newest rerun's step (so the evidence gains the step's batch ids) and the rank's device;
``ampscope status --prometheus`` feeds counts only. Pure: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.ranks import RankRef
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import Verdict, affected, rule_verdicts


@dataclass(frozen=True, kw_only=True)
class RerunDetail:
    """A rank's newest rerun of a given result, where the source holds it."""

    step: int
    first_loss: float | None = None
    second_loss: float | None = None
    first_norm: float | None = None
    second_norm: float | None = None


@dataclass(frozen=True, kw_only=True)
class RerunFacts(RankRef):
    """How many reruns of one result a rank had within ``spike_verdict_window_s``, and
    (from an exporter) the newest one and the rank's device."""

    reruns: int
    newest: RerunDetail | None = None
    device: str | None = None
    """The device the rank named (a GPU's UUID), when known."""


def _entry(f: RerunFacts) -> dict[str, Any]:
    out: dict[str, Any] = {**f.ref(), "reruns": f.reruns}
    if f.device is not None:
        out["device"] = f.device
    d = f.newest
    if d is not None:
        out |= {
            "step": d.step,
            "first": {"loss": d.first_loss, "norm": d.first_norm},
            "second": {"loss": d.second_loss, "norm": d.second_norm},
        }
    return out


def _lead(hits: list[RerunFacts]) -> RerunFacts:
    detailed = [f for f in hits if f.newest is not None]
    if not detailed:
        return hits[0]
    return max(detailed, key=lambda f: (f.newest.step, -f.rank))  # type: ignore[union-attr]


def transient_fault(ranks: Sequence[RerunFacts], t: Thresholds) -> Verdict:
    """Critical while a rank's flagged result was not reproduced by its rerun within
    ``spike_verdict_window_s``: suspect that rank's device. Names rank, node, device, step."""
    say = rule_verdicts("transient_fault", t)
    hits = sorted((f for f in ranks if f.reruns > 0), key=lambda f: f.rank)
    if not hits:
        return say(
            "ok",
            f"no rerun failed to reproduce a result within {t.spike_verdict_window_s:g} s",
            {"ranks_affected": 0},
        )
    lead = _lead(hits)
    where = f"rank {lead.rank} (node {lead.node}"
    where += f", device {lead.device})" if lead.device is not None else ")"
    at = f" at step {lead.newest.step}" if lead.newest is not None else ""
    summary = (
        f"{where}: its result{at} was not reproduced by the rerun from the same batch; "
        "suspect its device"
    )
    if len(hits) > 1:
        summary += f"; {len(hits)} rank(s) had transient results"
    total = sum(f.reruns for f in hits)
    return say("critical", summary, affected([_entry(f) for f in hits], reruns=total))


def reproducible_fault(ranks: Sequence[RerunFacts], t: Thresholds) -> Verdict:
    """Warning while a rerun reproduced a rank's flagged result within
    ``spike_verdict_window_s``: the data or the numerics. Names step, rank (and, from an
    exporter, the step's batch ids)."""
    say = rule_verdicts("reproducible_fault", t)
    hits = sorted((f for f in ranks if f.reruns > 0), key=lambda f: f.rank)
    if not hits:
        return say(
            "ok",
            f"no rerun reproduced a flagged result within {t.spike_verdict_window_s:g} s",
            {"ranks_affected": 0},
        )
    lead = _lead(hits)
    at = f" at step {lead.newest.step}" if lead.newest is not None else ""
    summary = (
        f"the rerun reproduced rank {lead.rank}'s flagged result{at} (node {lead.node}): "
        "the data or the numerics; see the step's batch ids"
    )
    if len(hits) > 1:
        summary += f"; {len(hits)} rank(s) had reproducible results"
    total = sum(f.reruns for f in hits)
    return say("warning", summary, affected([_entry(f) for f in hits], reruns=total))
