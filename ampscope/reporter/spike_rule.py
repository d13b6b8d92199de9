"""The spike rule, defined once: when a value stands far above its own recent history.

Both sides apply it, which is why it lives beside the record schema: a rank to its own loss
and gradient norm (to know which iterations are spikes, and record their top parameters),
the exporter to each rank's reported history (the ``loss_spike`` and ``grad_norm_spike``
verdicts and ``ampscope_spikes_total``). The default is OLMo-core's rule: more than 6 sigma above
the mean of the preceding 100 iterations once at least 20 are known; on top of it a ratio
guard, at least 3 times the window's median, so that a window with almost no variance (a plateau)
does not turn every ripple into a spike. A ratio says something only of a series that stays
above 0 (a cross-entropy loss, a gradient norm): a window whose median is 0 or below, or more than
a tenth of whose values are negative (``NEGATIVE_SHARE``: a negative log-likelihood, an RL
objective, a loss centred on 0; a gradient norm of 0 while every layer is frozen), judges
nothing, where the guard would let every ripple through. A few negative values (a dip of a
positive loss, an entropy bonus summed in now and then) leave the rule as it is.

Only the standard library is imported. ``SpikeWindow.observe`` is O(1) (amortised) on a value
below ratio times the window's minimum, which it keeps as values come and go: most values of a
steady series; O(window) on the others (the mean and spread, tens of microseconds over 100
values) and O(window log window) on the rare values that pass the sigma test; it keeps no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

NEGATIVE_SHARE = 0.1
"""The largest share of a window's values below 0 with which it is still judged."""


@dataclass(frozen=True, kw_only=True)
class SpikeRule:
    """Thresholds of the spike test. The defaults are OLMo-core's, plus the ratio guard."""

    sigmas: float = 6.0
    """A spike stands more than this many standard deviations above the window's mean."""
    window: int = 100
    """Preceding values the test compares against (non-overflow iterations only)."""
    min_window: int = 20
    """No value is a spike before this many preceding values are known."""
    ratio: float = 3.0
    """A spike is also at least this many times the window's median."""

    def __post_init__(self) -> None:
        if not (self.sigmas > 0 and math.isfinite(self.sigmas)):
            raise ValueError(f"sigmas must be a positive finite number, not {self.sigmas!r}")
        if not (self.ratio >= 1 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio must be a finite number >= 1, not {self.ratio!r}")
        if not 2 <= self.min_window <= self.window:
            raise ValueError(
                f"need 2 <= min_window <= window, not min_window={self.min_window}, "
                f"window={self.window}"
            )


@dataclass(frozen=True)
class Spike:
    """A value the rule flagged, with the baseline it was judged against."""

    value: float
    mean: float
    """Mean of the preceding window."""
    stdev: float
    """Population standard deviation of the preceding window."""
    median: float
    """Median of the preceding window."""


class SpikeWindow:
    """One series' recent history (one rank's loss, say) and the rule applied to it.

    Not thread-safe: one owner feeds it in step order.
    """

    def __init__(self, rule: SpikeRule | None = None) -> None:
        self.rule = rule or SpikeRule()
        self._values: deque[float] = deque(maxlen=self.rule.window)
        self._minima: deque[tuple[int, float]] = deque()
        """(index, value) of the window's ascending minima, oldest first: its first is the
        window's minimum. Each value enters and leaves once, so the minimum costs O(1) per
        value instead of a pass over the window."""
        self._count = 0
        """Values kept so far (the index of the next one)."""
        self._negatives = 0
        """Values below 0 in the window."""

    def __len__(self) -> int:
        return len(self._values)

    def observe(self, value: float | None) -> Spike | None:
        """Judges ``value`` against the preceding window, then adds it to the window.

        ``None`` (an overflow iteration) and non-finite values are neither judged nor kept:
        they are the overflow detectors' business, and would poison the baseline. A spike is
        kept, so a lasting change of level becomes the new baseline instead of firing
        forever.
        """
        if value is None or not math.isfinite(value):
            return None
        values, minima = self._values, self._minima
        # The ratio guard against the window's minimum settles most values of a steady
        # series here, without the calls of the full test (_judge, which repeats it) or
        # of _ratio_bound (its product, spelled out).
        rule = self.rule
        if len(values) < rule.min_window or value < rule.ratio * minima[0][1]:
            spike = None
        else:
            spike = self._judge(value)
        if len(values) == values.maxlen and values[0] < 0:
            self._negatives -= 1  # leaves the window with this append
        if value < 0:
            self._negatives += 1
        values.append(value)
        while minima and minima[-1][1] >= value:
            minima.pop()
        minima.append((self._count, value))
        self._count += 1
        if minima[0][0] <= self._count - 1 - rule.window:
            minima.popleft()  # left the window
        return spike

    def threshold(self) -> float:
        """The least value :meth:`observe` would judge a spike now: ``inf`` while fewer than
        ``min_window`` values are known, or while its median is 0 or below or more than
        ``NEGATIVE_SHARE`` of it is negative (no ratio to judge by). O(window log window) (the
        median).

        A rank's front-end compares its loss and gradient norm against it on the device,
        to rerun a spike iteration (``rerun=closure``) without reading either on the host.
        """
        values = self._values
        if len(values) < self.rule.min_window or not self._judges_by_ratio():
            return math.inf
        median = statistics.median(values)
        if median <= 0:
            return math.inf
        mean, stdev = _spread(values)
        # value > sigma bound (strictly) and value >= ratio bound: the least such value.
        above_sigmas = math.nextafter(self._sigma_bound(mean, stdev), math.inf)
        return max(above_sigmas, self._ratio_bound(median))

    def _judges_by_ratio(self) -> bool:
        """Whether few enough of the window's values are negative for a ratio to its median
        to say something (the median itself is checked where it is computed). O(1)."""
        return self._negatives <= NEGATIVE_SHARE * len(self._values)

    def _sigma_bound(self, mean: float, stdev: float) -> float:
        """A spike stands strictly above this."""
        return mean + self.rule.sigmas * stdev

    def _ratio_bound(self, median: float) -> float:
        """A spike is at least this."""
        return self.rule.ratio * median

    def _judge(self, value: float) -> Spike | None:
        if len(self._values) < self.rule.min_window:
            return None
        if not self._judges_by_ratio():
            return None
        values = self._values
        # The window's minimum is at most its median: below ratio x minimum, the value
        # fails the ratio guard, which settles most values of a steady series.
        if value < self._ratio_bound(self._minima[0][1]):
            return None
        mean, stdev = _spread(values)
        if value <= self._sigma_bound(mean, stdev):
            return None
        median = statistics.median(self._values)
        if median <= 0 or value < self._ratio_bound(median):
            return None
        return Spike(value=value, mean=mean, stdev=stdev, median=median)


def _spread(values: deque[float]) -> tuple[float, float]:
    """The mean and the population standard deviation of ``values``."""
    mean = statistics.fmean(values)
    # statistics.pstdev computes it in exact fractions, ten times slower, and a rank
    # judges two series per iteration.
    stdev = math.sqrt(math.fsum([(v - mean) * (v - mean) for v in values]) / len(values))
    return mean, stdev
