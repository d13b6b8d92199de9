"""Robust summaries of timing samples: medians, quartiles and bootstrap intervals.

Pure Python (no numpy in the environment). Every function is O(n log n) in the number
of samples, fine for the few thousand samples a benchmark collects.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics.

    Raises:
        ValueError: for an empty sequence or ``q`` outside [0, 1].
    """
    if not samples:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Median and spread of one set of samples."""

    n: int
    median: float
    p25: float
    p75: float
    ci_low: float
    """Lower end of the 95% bootstrap interval of the median."""
    ci_high: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def bootstrap_median_ci(
    samples: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median; seeded, so results are reproducible."""
    if not samples:
        raise ValueError("bootstrap of no samples")
    rng = random.Random(seed)
    n = len(samples)
    medians = sorted(statistics.median(rng.choices(samples, k=n)) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


def summarize(samples: Sequence[float], *, resamples: int = 2000) -> Summary:
    """Median, quartiles and a 95% bootstrap interval of the median."""
    low, high = bootstrap_median_ci(samples, resamples=resamples)
    return Summary(
        n=len(samples),
        median=statistics.median(samples),
        p25=quantile(samples, 0.25),
        p75=quantile(samples, 0.75),
        ci_low=low,
        ci_high=high,
    )


def latency_percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50, p90 and p99 of latency samples, in the samples' unit."""
    return {
        "p50": quantile(samples, 0.50),
        "p90": quantile(samples, 0.90),
        "p99": quantile(samples, 0.99),
    }
