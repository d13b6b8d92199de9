"""bench.stats and bench.ab: the numbers every benchmark figure is summarised with."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.ab import compare_groups, interleaved_order, run_interleaved
from bench.stats import bootstrap_median_ci, latency_percentiles, quantile, summarize


def test_quantile_interpolates_between_order_statistics() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert quantile(samples, 0.0) == 1.0
    assert quantile(samples, 1.0) == 4.0
    assert quantile(samples, 0.5) == 2.5
    assert quantile(samples, 0.25) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match="within"):
        quantile(samples, 1.5)


def test_summary_and_bootstrap_interval_bracket_the_median() -> None:
    samples = [float(x) for x in range(1, 102)]  # median 51
    summary = summarize(samples, resamples=500)
    assert summary.n == 101
    assert summary.median == 51.0
    assert (summary.p25, summary.p75) == (26.0, 76.0)
    assert 40.0 < summary.ci_low < 51.0 < summary.ci_high < 62.0
    # Seeded: the same samples give the same interval.
    assert bootstrap_median_ci(samples, resamples=500) == (summary.ci_low, summary.ci_high)
    assert latency_percentiles(samples)["p99"] == pytest.approx(100.0)


def test_interleaved_order_balances_positions() -> None:
    assert [interleaved_order(g, ["A", "B"]) for g in range(4)] == [
        ["A", "B"],
        ["B", "A"],
        ["B", "A"],
        ["A", "B"],
    ]
    firsts = Counter(interleaved_order(g, ["A", "B", "C"])[0] for g in range(6))
    lasts = Counter(interleaved_order(g, ["A", "B", "C"])[-1] for g in range(6))
    assert firsts == lasts == Counter({"A": 2, "B": 2, "C": 2})


def test_per_group_ratio_cancels_drift_between_groups() -> None:
    # The machine gets 2x slower in every group; B is always 10% slower than A within
    # its group: every group's ratio, so the headline and its interval, is exactly 1.1.
    calls: list[str] = []
    group_speed = iter([1, 1, 2, 2, 4, 4, 8, 8])

    def block(name: str) -> list[float]:
        calls.append(name)
        base = next(group_speed) * 0.01
        return [base * (1.1 if name == "B" else 1.0)] * 3

    blocks = run_interleaved({"A": "A", "B": "B"}, block, groups=4)
    assert calls == ["A", "B", "B", "A", "B", "A", "A", "B"]
    result = compare_groups(blocks, baseline="A")
    ratio = result["ratio"]["B"]
    assert ratio["median"] == pytest.approx(1.1)
    assert ratio["ci_low"] == pytest.approx(1.1)
    assert ratio["groups"] == 4
    assert result["samples"]["A"]["n"] == 12
