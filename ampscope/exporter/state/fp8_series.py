"""The exporter's FP8 bookkeeping: each rank's FP8 series, judged as records arrive.

A series is one (layer, tensor) of a rank's torchao ``Float8Linear`` layers. ``RankFp8``
keeps, per series, its newest entry (``StepRecord.fp8``), the previous amaxes the spike
rule compares with, the recent underflow ratios, and the newest spike and non-finite amax
(``ampscope.verdicts.fp8``). An iteration the rank's loss scaler skipped for overflow is
shown as the newest entry but judged never: its gradients were not finite by design.

Bounded: at most ``MAX_FP8_TENSORS`` series per rank, each holding ``spike_window`` amaxes
and ``UNDERFLOW_KEPT`` ratios. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ampscope.reporter.schema import MAX_FP8_TENSORS, Fp8Tensor, StepRecord
from ampscope.verdicts.fp8 import Fp8Event, Fp8Rule

UNDERFLOW_KEPT = 16
"""Underflow ratios each series keeps (the rule reads the newest few)."""


@dataclass(frozen=True, kw_only=True)
class Fp8Series:
    """An immutable view of one series, for the collector, the API and the verdicts."""

    layer: str
    tensor: str
    step: int
    """Step of the newest entry."""
    entry: Fp8Tensor
    skipped: bool
    """The newest entry's iteration was skipped for overflow (not judged)."""
    baseline: float | None
    """Median of the amaxes the next observation is compared with (``None``: too few)."""
    underflow_recent: tuple[float, ...]
    spike: Fp8Event | None
    nonfinite: Fp8Event | None
    nonfinite_count: int = 0
    """Observations with an inf or NaN amax on iterations not skipped, since the exporter
    first heard the rank's process (``ampscope_fp8_nonfinite_amax_total``)."""


class _Held:
    __slots__ = (
        "entry",
        "nonfinite",
        "nonfinite_count",
        "previous",
        "skipped",
        "spike",
        "step",
        "underflow",
    )

    def __init__(self, window: int) -> None:
        self.previous: deque[float] = deque(maxlen=window)
        self.underflow: deque[float] = deque(maxlen=UNDERFLOW_KEPT)
        self.entry: Fp8Tensor | None = None
        self.step = 0
        self.skipped = False
        self.spike: Fp8Event | None = None
        self.nonfinite: Fp8Event | None = None
        self.nonfinite_count = 0


class RankFp8:
    """One rank's FP8 series.

    Args:
        rule: The FP8 rule (its spike thresholds judge each new observation).
    """

    def __init__(self, rule: Fp8Rule) -> None:
        self._rule = rule
        self._series: dict[tuple[str, str], _Held] = {}

    def reset(self) -> None:
        """Forget everything: the rank's process restarted."""
        self._series = {}

    def observe(self, record: StepRecord, received: float) -> None:
        """Judge a record that advanced the rank's newest step (calls come in step order).
        O(entries x spike_window) for the medians."""
        entries = record.fp8
        if not entries:
            return
        rule, series = self._rule, self._series
        for entry in entries:
            key = (entry.layer, entry.tensor)
            held = series.get(key)
            if held is None:
                if len(series) >= MAX_FP8_TENSORS:
                    continue
                held = series[key] = _Held(rule.spike_window)
            held.entry, held.step, held.skipped = entry, record.step, record.skipped
            if record.skipped:
                continue  # a skipped overflow iteration is no FP8 fault
            amax = entry.amax
            if amax is None:
                held.nonfinite = Fp8Event(
                    step=record.step, value=None, baseline=None, received=received
                )
                held.nonfinite_count += 1
                continue
            baseline = rule.is_spike(amax, held.previous)
            if baseline is not None:
                held.spike = Fp8Event(
                    step=record.step, value=amax, baseline=baseline, received=received
                )
            held.previous.append(amax)
            held.underflow.append(entry.underflow_ratio)

    def view(self, baselines: bool = True) -> tuple[Fp8Series, ...]:
        """Every series, in the order first seen. O(series x spike_window) with the
        ``baselines`` (the JSON API's), O(series) without (a scrape's)."""
        out = []
        for (layer, tensor), held in self._series.items():
            assert held.entry is not None
            out.append(
                Fp8Series(
                    layer=layer,
                    tensor=tensor,
                    step=held.step,
                    entry=held.entry,
                    skipped=held.skipped,
                    baseline=self._rule.baseline(list(held.previous)) if baselines else None,
                    underflow_recent=tuple(held.underflow),
                    spike=held.spike,
                    nonfinite=held.nonfinite,
                    nonfinite_count=held.nonfinite_count,
                )
            )
        return tuple(out)

    def layers(self) -> int:
        """Layers held. O(series)."""
        return len({layer for layer, _ in self._series})

    def series(self) -> int:
        """Series held. O(1)."""
        return len(self._series)

    def exposed(self) -> int:
        """Label sets /metrics may expose for this rank's FP8 series, at most: three
        families, three tensors for each of up to ``max_layers`` layers, and the non-finite
        amax counter of every series that counted one. O(series)."""
        if not self._series:
            return 0
        counted = sum(1 for held in self._series.values() if held.nonfinite_count)
        return 9 * min(self.layers(), self._rule.max_layers) + counted


def exported(
    series: tuple[Fp8Series, ...], max_layers: int, now: float, window_s: float
) -> list[Fp8Series]:
    """The series of the ``max_layers`` layers /metrics exposes: those with a live spike or
    non-finite amax first (newest event within ``window_s``), then the highest newest
    underflow ratio of any of their tensors; ties by layer name. O(series log series)."""
    score: dict[str, tuple[int, float]] = {}
    for s in series:
        live = any(
            e is not None and now - window_s <= e.received <= now for e in (s.spike, s.nonfinite)
        )
        mine = (int(live), s.entry.underflow_ratio)
        score[s.layer] = max(score.get(s.layer, mine), mine)
    chosen = set(
        sorted(score, key=lambda layer: (-score[layer][0], -score[layer][1], layer))[:max_layers]
    )
    return [s for s in series if s.layer in chosen]
