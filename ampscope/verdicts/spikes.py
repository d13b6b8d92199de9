"""The spike rules over a neutral view of each rank's spikes (``SpikeFacts``): ``loss_spike``,
``grad_norm_spike`` and ``origin_outlier``.

One implementation serves every caller, as for every rule of ``ampscope.verdicts``: the exporter's
health (``ampscope.exporter.health``, from the spikes its store found, with their step, value
and baseline) and ``ampscope status --prometheus`` (from the growth of
``ampscope_spikes_total`` within the window, counts only). Only pydantic and the standard
library are imported. All functions are pure: O(ranks), no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.ranks import RankRef
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, affected, rule_verdicts


@dataclass(frozen=True, kw_only=True)
class SpikeDetail:
    """One spike iteration, where the source holds it (an exporter; not Prometheus)."""

    step: int
    value: float
    median: float
    """The preceding window's median, or (origin outlier) the other ranks' median."""
    mean: float | None = None
    """The preceding window's mean (not for an origin outlier)."""
    stdev: float | None = None
    compared: int | None = None
    """Origin outlier: how many other ranks it was compared with."""
    top_params: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class SpikeFacts(RankRef):
    """What the spike rules read of one rank and one kind of spike: how many spike
    iterations lie within ``spike_verdict_window_s``, and the newest one's details when
    the source has them (``None`` from Prometheus, which holds only the counters)."""

    spikes: int
    newest: SpikeDetail | None = None


def _detail(detail: SpikeDetail | None) -> dict[str, Any]:
    if detail is None:
        return {}
    out: dict[str, Any] = {"step": detail.step, "value": detail.value, "median": detail.median}
    if detail.mean is not None:
        out["mean"], out["stdev"] = detail.mean, detail.stdev
    if detail.compared is not None:
        out["compared"] = detail.compared
        out["ratio"] = detail.value / detail.median if detail.median > 0 else None
    if detail.top_params:
        out["top_params"] = [{"name": n, "norm": v} for n, v in detail.top_params]
    return out


def _baseline(detail: SpikeDetail) -> str:
    return f"baseline mean {detail.mean:.4g} (sigma {detail.stdev:.3g}, median {detail.median:.4g})"


def _top_text(detail: SpikeDetail) -> str:
    if not detail.top_params:
        return ""
    name, norm = detail.top_params[0]
    return f"; largest parameter gradient: {name} ({norm:.3g})"


def loss_spike(ranks: Sequence[SpikeFacts], t: Thresholds) -> Verdict:
    """Warning while a rank's loss spiked (the spike rule over its own history) within
    ``spike_verdict_window_s``; names the rank, the step, the value and the baseline."""
    hits = sorted((f for f in ranks if f.spikes > 0), key=lambda f: f.rank)
    say = rule_verdicts("loss_spike", t)
    if not hits:
        return say(
            "ok", f"no loss spike within {t.spike_verdict_window_s:g} s", {"ranks_affected": 0}
        )
    listed = [{**f.ref(), "spikes": f.spikes, **_detail(f.newest)} for f in hits]
    detailed = [f for f in hits if f.newest is not None]
    total = sum(f.spikes for f in hits)
    if detailed:
        lead = max(detailed, key=lambda f: (f.newest.step, f.rank))  # type: ignore[union-attr]
        d = lead.newest
        assert d is not None
        summary = (
            f"loss spiked on rank {lead.rank} (node {lead.node}) at step {d.step}: "
            f"{d.value:.4g} against a {_baseline(d)}{_top_text(d)}"
        )
    else:
        lead = hits[0]
        summary = f"rank {lead.rank} (node {lead.node}) had a loss spike"
    summary += (
        f"; {total} spike iteration(s) on {len(hits)} rank(s) within {t.spike_verdict_window_s:g} s"
    )
    return say(
        "warning",
        summary,
        affected(listed, spikes=total),
    )


def grad_norm_spike(ranks: Sequence[SpikeFacts], t: Thresholds) -> Verdict:
    """Warning while the gradient norm spiked within ``spike_verdict_window_s``.

    The norm is the whole model's, the same on every rank, so every rank sees the same
    spike: the verdict names each step once (with how many ranks saw it), and counts the
    run's spike iterations as the most any rank counted, not their sum.
    """
    say = rule_verdicts("grad_norm_spike", t)
    hits = [f for f in ranks if f.spikes > 0]
    if not hits:
        return say(
            "ok", f"no gradient-norm spike within {t.spike_verdict_window_s:g} s", {"spikes": 0}
        )
    spikes = max(f.spikes for f in hits)
    steps: dict[int, dict[str, Any]] = {}
    for f in hits:
        if f.newest is None:
            continue
        entry = steps.setdefault(f.newest.step, {**_detail(f.newest), "ranks": []})
        entry["ranks"].append(f.rank)
    if steps:
        step = max(steps)
        newest = steps[step]
        lead = next(f.newest for f in hits if f.newest is not None and f.newest.step == step)
        summary = (
            f"gradient norm spiked at step {step}: {lead.value:.4g} against a "
            f"{_baseline(lead)}, seen by {len(newest['ranks'])} rank(s)"
        )
    else:
        summary = f"gradient norm spiked, seen by {len(hits)} rank(s)"
    summary += f"; {spikes} spike iteration(s) within {t.spike_verdict_window_s:g} s"
    ordered = [steps[s] for s in sorted(steps, reverse=True)]
    for entry in ordered:
        entry["ranks"] = sorted(entry["ranks"])[:MAX_EVIDENCE_RANKS]
    return say(
        "warning",
        summary,
        {"spikes": spikes, "ranks_seen": len(hits), "steps": ordered[:MAX_EVIDENCE_RANKS]},
    )


def origin_outlier(ranks: Sequence[SpikeFacts], t: Thresholds) -> Verdict:
    """Warning while a rank's own (pre-reduction) gradient norm stood ``origin_outlier_factor``
    times above the median of the other ranks of its origin group (its data-parallel
    replicas; the exporter's board compares no others) at the same step within the window: "rank R's
    own gradients were xN the median of the other ranks at step S". A rank that repeats
    across spikes points at its GPU or its data shard."""
    say = rule_verdicts("origin_outlier", t)
    hits = sorted((f for f in ranks if f.spikes > 0), key=lambda f: (-f.spikes, f.rank))
    if not hits:
        return say(
            "ok",
            f"no rank's own gradients stood out within {t.spike_verdict_window_s:g} s",
            {"ranks_affected": 0},
        )
    lead = hits[0]
    d = lead.newest
    if d is not None and d.median > 0:
        summary = (
            f"rank {lead.rank}'s own gradients were x{d.value / d.median:.3g} the median of "
            f"the other ranks at step {d.step} (node {lead.node}){_top_text(d)}"
        )
    else:
        summary = f"rank {lead.rank}'s own gradients stood out (node {lead.node})"
    if lead.spikes > 1:
        summary += f"; it stood out at {lead.spikes} steps: its GPU or its data shard"
    if len(hits) > 1:
        summary += f"; {len(hits)} rank(s) stood out within {t.spike_verdict_window_s:g} s"
    return say(
        "warning",
        summary,
        affected([{**f.ref(), "spikes": f.spikes, **_detail(f.newest)} for f in hits]),
    )
