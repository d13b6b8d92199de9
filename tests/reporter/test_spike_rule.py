"""The spike rule both the ranks and the exporter apply."""

from __future__ import annotations

import math
import random

import pytest

from ampscope.reporter.spike_rule import NEGATIVE_SHARE, SpikeRule, SpikeWindow


def _noisy(seed: int, n: int, level: float = 2.0, noise: float = 0.2) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0.0, noise) for _ in range(n)]


def test_a_noisy_but_stable_series_has_no_spike() -> None:
    window = SpikeWindow()
    assert [v for v in _noisy(1, 5000) if window.observe(v)] == []


def test_a_planted_spike_is_named_with_its_baseline() -> None:
    window = SpikeWindow()
    history = _noisy(2, 100)
    for value in history:
        assert window.observe(value) is None
    spike = window.observe(40.0)
    assert spike is not None
    assert spike.value == 40.0
    assert spike.mean == pytest.approx(sum(history) / 100)
    assert 0.1 < spike.stdev < 0.3
    assert 1.5 < spike.median < 2.5


@pytest.mark.parametrize(("known", "fires"), [(19, False), (20, True)])
def test_nothing_fires_before_the_minimum_window(known: int, fires: bool) -> None:
    window = SpikeWindow(SpikeRule(min_window=20, window=100))
    for value in _noisy(3, known):
        window.observe(value)
    assert (window.observe(1000.0) is not None) is fires


def test_overflows_and_non_finite_values_stay_out_of_the_window() -> None:
    window = SpikeWindow()
    for value in _noisy(4, 30):
        window.observe(value)
    for value in (None, math.inf, math.nan):
        assert window.observe(value) is None
    assert len(window) == 30


def test_the_ratio_guard_spares_a_flat_window() -> None:
    # A plateau has almost no variance: 6 sigma is a hair above it, but not 3x its median.
    window = SpikeWindow()
    for i in range(50):
        window.observe(1.0 + (i % 2) * 1e-6)
    assert window.observe(1.5) is None
    assert window.observe(3.5) is not None


def test_a_lasting_change_of_level_stops_firing() -> None:
    window = SpikeWindow(SpikeRule(window=100))
    for value in _noisy(5, 100):
        window.observe(value)
    fired = [i for i, v in enumerate(_noisy(6, 300, level=20.0)) if window.observe(v)]
    # Once the new level fills the window it is the baseline, not a spike.
    assert fired
    assert fired[-1] < 100


@pytest.mark.parametrize("level", [-2.0, 0.0])
def test_a_series_that_is_not_positive_judges_nothing(level: float) -> None:
    # A negative log-likelihood or an RL objective: 3x a median at or below 0 is no guard,
    # and 1% of outlier batches 8 sigma up fired as spikes (and reruns). The same series
    # lifted above 0 is judged by the rule as always.
    rng = random.Random(7)
    series = [
        level + (8 * 0.1 if rng.random() < 0.01 else rng.gauss(0.0, 0.1)) for _ in range(3000)
    ]
    below, lifted = SpikeWindow(), SpikeWindow()
    assert [v for v in series if below.observe(v)] == []
    assert below.threshold() == math.inf
    assert [v for v in series if lifted.observe(v + 2.0 - level)] == []  # 8 sigma < 3x
    # A planted spike far above a positive baseline still fires; below 0, nothing does.
    assert lifted.observe(40.0) is not None
    assert below.observe(40.0) is None


def test_a_few_negative_values_leave_a_positive_loss_judged() -> None:
    # A positive loss that dips below 0 once (a bug, an entropy bonus summed in): a later
    # spike still fires, and the window keeps its count of negatives as values leave it.
    window = SpikeWindow()
    for i, value in enumerate(_noisy(8, 300)):
        window.observe(-0.01 if i in (50, 120) else value)
        assert (window.threshold() < math.inf) is (i + 1 >= 20)
    assert window.observe(20.0) is not None
    # More than a tenth below 0: not judged; judged again once they left the window.
    for i in range(100):
        window.observe(-0.5 if i % 5 == 0 else 2.0)
    assert window.threshold() == math.inf
    for value in _noisy(9, 100):
        window.observe(value)
    assert window.threshold() < math.inf
    assert window.observe(20.0) is not None


def test_a_gradient_norm_of_zero_while_frozen_is_no_baseline() -> None:
    # Every layer frozen for the first steps (norm 0), then unfrozen: not a spike.
    window = SpikeWindow()
    for _ in range(50):
        assert window.observe(0.0) is None
    assert window.threshold() == math.inf
    assert window.observe(1.0) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"sigmas": 0.0},
        {"sigmas": math.inf},
        {"ratio": 0.5},
        {"min_window": 1},
        {"min_window": 200, "window": 100},
    ],
)
def test_impossible_thresholds_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must be|need"):
        SpikeRule(**bad)  # type: ignore[arg-type]


def test_the_minimum_shortcut_judges_as_the_full_rule() -> None:
    """Values below ratio x the window's minimum are rejected without the full test; the
    verdicts must be those of the rule itself, for positive, mixed and negative series (the
    last two judge nothing: no ratio to a baseline below 0)."""
    rule = SpikeRule(window=30, min_window=5)
    for level, noise in ((2.0, 0.2), (0.0, 1.0), (-10.0, 0.5)):
        rng = random.Random(level)
        values = [level + rng.gauss(0.0, noise) for _ in range(400)]
        values += [level + 50 * noise, abs(level) * 4 + 8 * noise]
        window, history, fired = SpikeWindow(rule), [], 0
        for value in values:
            spike = window.observe(value)
            recent = history[-rule.window :]
            expected = None
            if len(recent) >= rule.min_window:
                mean = sum(recent) / len(recent)
                stdev = math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
                median = (
                    sorted(recent)[len(recent) // 2]
                    if len(recent) % 2
                    else sum(sorted(recent)[len(recent) // 2 - 1 : len(recent) // 2 + 1]) / 2
                )
                negatives = sum(v < 0 for v in recent)
                positive = negatives <= NEGATIVE_SHARE * len(recent) and median > 0
                if positive and value > mean + rule.sigmas * stdev and value >= rule.ratio * median:
                    expected = value
            assert (spike.value if spike else None) == expected, (level, value)
            fired += spike is not None
            history.append(value)
        if level > 0:
            assert fired >= 1, f"the planted spikes of level {level} must fire"


def test_a_value_at_exactly_ratio_times_a_flat_windows_level_is_a_spike() -> None:
    """On a flat window (minimum = median) the ratio guard is met at equality: the
    minimum's shortcut must not turn ``>=`` into ``>``."""
    rule = SpikeRule(window=30, min_window=5)
    window = SpikeWindow(rule)
    for _ in range(20):
        assert window.observe(2.0) is None
    spike = window.observe(rule.ratio * 2.0)
    assert spike is not None
    assert spike.value == rule.ratio * 2.0


def test_the_threshold_is_the_least_value_observe_calls_a_spike() -> None:
    """What a rank compares on the device must be the rule itself: at the threshold a value
    is a spike, one float below it is not, on positive, mixed and negative series."""
    rule = SpikeRule(window=30, min_window=5)
    for level, noise in ((2.0, 0.2), (0.0, 1.0), (-10.0, 0.5)):
        rng = random.Random(level)
        window = SpikeWindow(rule)
        assert window.threshold() == math.inf
        for _ in range(200):
            window.observe(level + rng.gauss(0.0, noise))
            limit = window.threshold()
            if len(window) < rule.min_window:
                assert limit == math.inf
                continue
            if limit == math.inf:
                assert level <= 0, "only a window without a positive baseline judges nothing"
                assert window._judge(1e300) is None
                continue
            assert window._judge(limit) is not None, (level, limit)
            assert window._judge(math.nextafter(limit, -math.inf)) is None, (level, limit)


@pytest.mark.parametrize(
    "series",
    [
        [float(i) for i in range(300)],  # rising: the minimum leaves the window every value
        [float(300 - i) for i in range(300)],  # falling: the newest is always the minimum
        [1.0] * 150 + [0.5] * 10 + [1.0] * 140,  # ties, a dip that leaves the window
        [0.0, -0.0] * 100 + [-1.0, 1.0] * 50,  # signed zeros
        [math.sin(i / 7.0) * 3 + (i % 13) for i in range(400)],
    ],
    ids=["rising", "falling", "ties", "signed-zeros", "wave"],
)
def test_the_running_minimum_is_the_windows_minimum(series: list[float]) -> None:
    """The window keeps its minimum as values come and go (no pass over the window per
    value); it must equal min() of the window after every value, skipped ones included."""
    rule = SpikeRule(window=25, min_window=5)
    window = SpikeWindow(rule)
    rng = random.Random(5)
    for value in series:
        if rng.random() < 0.1:
            window.observe(rng.choice([None, math.nan, math.inf]))  # neither judged nor kept
        window.observe(value)
        assert window._minima[0][1] == min(window._values)
        assert len(window._minima) <= len(window._values) <= rule.window
