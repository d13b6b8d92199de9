"""The loss-scale rules: ``scale_collapse`` and ``scale_desync``, over the scaler ranks only
(a watch's records say scale 1, which is no scale: ``ampscope.verdicts.ranks.is_scaler``).

``scale_desync`` compares the ranks' *aligned* scales: each scaler rank reports, in its
cumulative totals, its scale after its newest step that is a multiple of
``SCALE_ALIGN_STEPS`` (``RankTotals.aligned_scale``, ``ampscope_loss_scale_aligned``), and
ranks at the same aligned step must agree. That is the one desync algorithm, chosen over
comparing each step of the exporter's held record histories (what the exporter's health did
until the verdict rules became one package) because:

- every source holds it: the exporter's store, each exporter's ``/ranks`` JSON and
  Prometheus alike, so the exporter, ``ampscope status`` over several exporters (a desync
  between nodes), ``--prometheus`` and the ``AmpscopeScaleDesync`` alert all judge the same
  numbers and agree; a per-step comparison needs the held histories of every rank in one
  place, which only a single node's exporter has;
- it does not depend on how much history is held: ``history_length`` and the history byte
  budget (which drops the oldest records under memory pressure) decide what a per-step
  comparison sees, not what the aligned scale is; and it rides in the cumulative totals, so
  a dropped record loses nothing;
- it costs O(ranks), not O(ranks x history_length).

What it gives up: a desync is seen at the next aligned step (at most ``SCALE_ALIGN_STEPS``
steps later), and one that heals between two aligned steps is not seen at all; a scaler's
scale follows deterministically from the found-inf it is told, so ranks that diverged stay
apart until something resets them. The run page's scale chart still shows every held step.

Pure functions: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.ranks import RankRef
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, affected, rule_verdicts


@dataclass(frozen=True, kw_only=True)
class ScaleFacts(RankRef):
    """What ``scale_collapse`` reads of a rank."""

    scaler: bool
    """Whether it runs a loss scaler (a watch's scale is no scale)."""
    scale: float
    window_peak_scale: float
    """Its highest scale within the collapse window, the current one included."""


NO_SCALE = "no rank has a loss scale: every rank runs a watch (bf16/fp32)"
"""The summary of the scale rules for a run of watch ranks only."""


def scale_collapse(ranks: Sequence[ScaleFacts], t: Thresholds) -> Verdict:
    """Critical when a rank's scale is below the floor or fell by ``collapse_factor``
    from its peak within the collapse window."""
    say = rule_verdicts("scale_collapse", t)
    hits: list[dict[str, Any]] = []
    lowest = None
    scalers = [facts for facts in ranks if facts.scaler]
    for facts in scalers:
        scale, peak = facts.scale, facts.window_peak_scale
        fall = peak / scale if scale > 0 else float("inf")
        lowest = scale if lowest is None else min(lowest, scale)
        reasons = []
        if scale < t.scale_floor:
            reasons.append("below_floor")
        if fall >= t.collapse_factor:
            reasons.append("fell")
        if reasons:
            hits.append(
                {
                    **facts.ref(),
                    "scale": scale,
                    "window_peak_scale": peak,
                    "fall_factor": fall if scale > 0 else None,
                    "reasons": reasons,
                }
            )
    if not hits:
        return say(
            "ok",
            "no rank's loss scale collapsed" if scalers or not ranks else NO_SCALE,
            {"lowest_scale": lowest},
        )
    worst = min(hits, key=lambda h: h["scale"])
    return say(
        "critical",
        f"loss scale collapsed on {len(hits)} rank(s): rank {worst['rank']} is at "
        f"{worst['scale']:g} (window peak {worst['window_peak_scale']:g})",
        affected(hits),
    )


@dataclass(frozen=True, kw_only=True)
class AlignedFacts(RankRef):
    """What ``scale_desync`` reads of a rank: whether it runs a scaler, and its scale after
    its newest step that is a multiple of ``SCALE_ALIGN_STEPS`` (``RankTotals.aligned_scale``,
    ``ampscope_loss_scale_aligned``), if it reached one."""

    scaler: bool
    """Whether it runs a loss scaler (a watch's scale is no scale)."""
    step: int | None
    """Its newest aligned step; ``None`` before its first (or for a watch)."""
    scale: float | None


def scale_desync(ranks: Sequence[AlignedFacts]) -> Verdict:
    """Critical when scaler ranks at the same aligned step hold different scales; the ranks
    that differ from the majority's scale at the newest such step are named, with their
    nodes. Ranks at different aligned steps (some lag) are not compared. O(ranks).
    """
    scalers = [facts for facts in ranks if facts.scaler]
    by_step: dict[int, list[AlignedFacts]] = {}
    for facts in scalers:
        if facts.step is not None and facts.scale is not None:
            by_step.setdefault(facts.step, []).append(facts)
    compared = sorted(step for step, group in by_step.items() if len(group) > 1)
    mismatched = [step for step in compared if len({f.scale for f in by_step[step]}) > 1]
    say = rule_verdicts("scale_desync")
    if not mismatched:
        return say(
            "ok",
            f"ranks agree on the scale at {len(compared)} shared aligned step(s)"
            if scalers or not ranks
            else NO_SCALE,
            {"compared_steps": len(compared), "source": "aligned"},
        )
    step = mismatched[-1]
    group = sorted(by_step[step], key=lambda f: f.rank)
    counts: dict[float, int] = {}
    for facts in group:
        assert facts.scale is not None  # grouped by step only with a scale
        counts[facts.scale] = counts.get(facts.scale, 0) + 1
    majority = max(counts, key=lambda scale: counts[scale])
    odd = [f for f in group if f.scale != majority]
    nodes = sorted({f.node for f in odd})
    return say(
        "critical",
        f"ranks disagree on the loss scale at aligned step {step}: {len(odd)} of "
        f"{len(group)} rank(s) differ from the majority's {majority:g}, on node(s) "
        + ", ".join(nodes[:MAX_EVIDENCE_RANKS]),
        {
            "source": "aligned",
            "compared_steps": len(compared),
            "mismatched_steps": len(mismatched),
            "newest_mismatched_step": step,
            "ranks_at_newest": len(group),
            "majority_scale": majority,
            "ranks": [{**f.ref(), "scale": f.scale} for f in odd[:MAX_EVIDENCE_RANKS]],
        },
    )
