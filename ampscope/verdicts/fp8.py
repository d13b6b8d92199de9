"""The FP8 health rules, over a neutral view of each rank's FP8 series.

A series is one (rank, layer, tensor) of a model's torchao ``Float8Linear`` layers: its
observations (one iteration in ``fp8_every``, iterations a loss scaler skipped for
overflow left out) as the exporter keeps them. Three rules read them:

* ``fp8_amax_spike`` (warning): an amax at least ``spike_factor`` times the median of the
  series' previous ``spike_window`` observations, at least ``spike_min_window`` known;
* ``fp8_underflow`` (warning): more than ``underflow_ratio`` of the tensor's non-zero
  elements underflowed in each of the series' last ``underflow_observations``;
* ``fp8_nonfinite_amax`` (critical): an amax that was inf or NaN.

The spike and non-finite rules keep firing while their newest event is at most
``spike_verdict_window_s`` old (exporter clock), as the loss spike does. Only the standard
library and the verdict model are imported; all functions are pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.verdict import Verdict

MAX_EVIDENCE_SERIES = 16
"""Series listed in one verdict's evidence at most (the count is always given)."""


@dataclass(frozen=True, kw_only=True)
class Fp8Rule:
    """The FP8 rules' thresholds (exporter settings ``fp8_*``)."""

    spike_factor: float = 10.0
    """An amax spike is at least this many times the median of the preceding window."""
    spike_window: int = 100
    """Preceding observations the spike test compares against."""
    spike_min_window: int = 20
    """No spike before this many preceding observations are known."""
    underflow_ratio: float = 0.10
    """Underflow: more than this share of the non-zero elements became zero..."""
    underflow_observations: int = 5
    """...in each of this many most recent observations."""
    max_layers: int = 16
    """Layers per rank exported on /metrics (the JSON API holds all)."""

    def __post_init__(self) -> None:
        if not self.spike_factor > 1:
            raise ValueError("fp8_spike_factor must be > 1")
        if not 1 <= self.spike_min_window <= self.spike_window:
            raise ValueError("fp8 spike windows must satisfy 1 <= min_window <= window")
        if not 0 <= self.underflow_ratio < 1:
            raise ValueError("fp8_underflow_ratio must be within [0, 1)")
        if self.underflow_observations < 1 or self.max_layers < 1:
            raise ValueError("fp8_underflow_observations and fp8_max_layers must be >= 1")

    def baseline(self, previous: Sequence[float]) -> float | None:
        """The median a new amax is compared with; ``None`` while too few are known."""
        if len(previous) < self.spike_min_window:
            return None
        return statistics.median(list(previous)[-self.spike_window :])

    def is_spike(self, amax: float, previous: Sequence[float]) -> float | None:
        """The baseline when ``amax`` spikes over ``previous``, else ``None``."""
        baseline = self.baseline(previous)
        if baseline is None or baseline <= 0:
            return None
        return baseline if amax >= self.spike_factor * baseline else None


@dataclass(frozen=True, kw_only=True)
class Fp8Event:
    """One judged observation: a spike (``value`` and ``baseline``) or a non-finite amax
    (``value`` ``None``)."""

    step: int
    value: float | None
    baseline: float | None
    received: float
    """Exporter clock when it was judged."""


@dataclass(frozen=True, kw_only=True)
class Fp8Facts:
    """What the FP8 rules read of one series."""

    rank: int
    node: str
    layer: str
    tensor: str
    step: int
    """Step of the newest observation."""
    underflow_recent: tuple[float, ...]
    """Underflow ratios of the newest observations, oldest first."""
    spike: Fp8Event | None
    nonfinite: Fp8Event | None


def _who(facts: Fp8Facts) -> dict[str, Any]:
    return {"rank": facts.rank, "node": facts.node, "layer": facts.layer, "tensor": facts.tensor}


def _live(event: Fp8Event | None, now: float, window_s: float) -> bool:
    return event is not None and now - window_s <= event.received <= now


def _step_text(entry: Mapping[str, Any]) -> str:
    """`` at step N``, or nothing where the step is not known (computed from Prometheus)."""
    step = entry.get("step")
    return "" if step is None else f" at step {step}"


def spike_thresholds(rule: Fp8Rule, window_s: float) -> dict[str, float]:
    """What ``fp8_amax_spike`` reports it judged with."""
    return {
        "factor": rule.spike_factor,
        "window": rule.spike_window,
        "min_window": rule.spike_min_window,
        "window_s": window_s,
    }


def underflow_thresholds(rule: Fp8Rule) -> dict[str, float]:
    """What ``fp8_underflow`` reports it judged with."""
    return {"ratio": rule.underflow_ratio, "observations": rule.underflow_observations}


def spike_verdict(
    listed: Sequence[Mapping[str, Any]], affected: int, series: int, thresholds: Mapping[str, Any]
) -> Verdict:
    """``fp8_amax_spike`` from its flagged series, newest spike first (``rank``, ``node``,
    ``layer``, ``tensor``, ``step``, ``value``, ``baseline``, ``factor`` each), ``affected``
    of them in all, of ``series`` judged. O(listed)."""
    if not affected:
        return Verdict(
            rule="fp8_amax_spike",
            status="ok",
            summary=f"no FP8 amax spike in {series} series" if series else "no FP8 layers",
            evidence={"series": series},
            thresholds=dict(thresholds),
        )
    first = listed[0]
    return Verdict(
        rule="fp8_amax_spike",
        status="warning",
        summary=f"FP8 amax spiked in {affected} series: rank {first['rank']} layer "
        f"{first['layer']} {first['tensor']}{_step_text(first)}: {first['value']:.4g}, "
        f"{first['factor']:.0f}x its median {first['baseline']:.4g}",
        evidence={"series_affected": affected, "series": list(listed[:MAX_EVIDENCE_SERIES])},
        thresholds=dict(thresholds),
    )


def underflow_verdict(
    listed: Sequence[Mapping[str, Any]],
    affected: int,
    series: int,
    worst: float,
    thresholds: Mapping[str, Any],
) -> Verdict:
    """``fp8_underflow`` from its flagged series, highest newest ``ratio`` first, ``affected``
    of them in all, of ``series`` judged; ``worst``: the highest newest ratio of any series.
    O(listed)."""
    if not affected:
        return Verdict(
            rule="fp8_underflow",
            status="ok",
            summary=f"FP8 underflow within bounds in {series} series"
            if series
            else "no FP8 layers",
            evidence={"series": series, "worst_ratio": worst},
            thresholds=dict(thresholds),
        )
    first = listed[0]
    return Verdict(
        rule="fp8_underflow",
        status="warning",
        summary=f"FP8 casts underflow in {affected} series: rank {first['rank']} layer "
        f"{first['layer']} {first['tensor']} turns {first['ratio']:.0%} of its non-zero "
        f"values into zero",
        evidence={"series_affected": affected, "series": list(listed[:MAX_EVIDENCE_SERIES])},
        thresholds=dict(thresholds),
    )


def nonfinite_verdict(
    listed: Sequence[Mapping[str, Any]], affected: int, series: int, thresholds: Mapping[str, Any]
) -> Verdict:
    """``fp8_nonfinite_amax`` from its flagged series, earliest ``step`` first (``None``: not
    known), ``affected`` of them in all, of ``series`` judged. O(listed)."""
    if not affected:
        return Verdict(
            rule="fp8_nonfinite_amax",
            status="ok",
            summary="every FP8 amax is finite" if series else "no FP8 layers",
            evidence={"series": series},
            thresholds=dict(thresholds),
        )
    first = listed[0]
    return Verdict(
        rule="fp8_nonfinite_amax",
        status="critical",
        summary=f"FP8 amax not finite in {affected} series: first rank {first['rank']} "
        f"layer {first['layer']} {first['tensor']}{_step_text(first)}",
        evidence={"series_affected": affected, "series": list(listed[:MAX_EVIDENCE_SERIES])},
        thresholds=dict(thresholds),
    )


def fp8_amax_spike(
    series: Sequence[Fp8Facts], rule: Fp8Rule, now: float, window_s: float
) -> Verdict:
    """Warning while a series' newest amax spike is at most ``window_s`` old. O(series)."""
    hits = [f for f in series if _live(f.spike, now, window_s)]
    listed = []
    for facts in sorted(hits, key=lambda f: -(f.spike.received if f.spike else 0)):
        spike = facts.spike
        assert spike is not None
        assert spike.value is not None
        assert spike.baseline is not None
        listed.append(
            {
                **_who(facts),
                "step": spike.step,
                "value": spike.value,
                "baseline": spike.baseline,
                "factor": spike.value / spike.baseline,
            }
        )
    return spike_verdict(listed, len(hits), len(series), spike_thresholds(rule, window_s))


def fp8_underflow(series: Sequence[Fp8Facts], rule: Fp8Rule) -> Verdict:
    """Warning when a series underflowed above the ratio in each of its last
    ``underflow_observations`` observations. O(series)."""
    need = rule.underflow_observations
    hits = [
        f
        for f in series
        if len(f.underflow_recent) >= need
        and all(r > rule.underflow_ratio for r in f.underflow_recent[-need:])
    ]
    worst = max((f.underflow_recent[-1] for f in series if f.underflow_recent), default=0.0)
    listed = sorted(
        ({**_who(f), "step": f.step, "ratio": f.underflow_recent[-1]} for f in hits),
        key=lambda h: -h["ratio"],
    )
    return underflow_verdict(listed, len(hits), len(series), worst, underflow_thresholds(rule))


def fp8_nonfinite_amax(series: Sequence[Fp8Facts], now: float, window_s: float) -> Verdict:
    """Critical while a series' newest non-finite amax is at most ``window_s`` old.
    Iterations a loss scaler skipped for overflow never count (the exporter leaves them
    out of the series). O(series)."""
    hits = [f for f in series if _live(f.nonfinite, now, window_s)]
    listed = sorted(
        ({**_who(f), "step": f.nonfinite.step} for f in hits if f.nonfinite is not None),
        key=lambda h: (h["step"], h["rank"]),
    )
    return nonfinite_verdict(listed, len(hits), len(series), {"window_s": window_s})
