"""The exporter's log of refused requests: a summary by reason, at most once per interval.

A rank with the wrong token or a reporter of another schema is refused on every post, a few
times a second per rank: one log line each would bury the log, and none leaves the operator
with only a counter (``ampscope_exporter_ingest_rejections_total``) to find. So the first
refusal after a quiet interval is logged at once, later ones are counted by reason, and their
summary is logged when the interval has passed (at the next refusal, or at the next
``flush``, which the app calls periodically and at shutdown). The clock is injected: what is
logged when depends on it alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable

SUMMARY_INTERVAL_S = 60.0
"""Least time between two summaries."""

HINTS = {
    "token_missing": "ranks send no token: set AMPSCOPE_TOKEN or AMPSCOPE_TOKEN_FILE on them",
    "token_wrong": "ranks send another token than --token-file holds",
    "invalid": "records that fail the schema: a reporter of another ampscope version?",
    "cardinality": "a limit (max_runs, max_ranks, max_series ...) is reached",
    "clock_skew": "a rank's clock runs ahead of the exporter's",
    "identity_conflict": "two processes report as the same rank",
}
"""What to check for the reasons a configuration, not an attack or a network, causes."""


class RefusalLog:
    """Counts refused requests by reason and logs their summary, rate-limited.

    Args:
        log: Where the summaries go (at WARNING).
        interval_s: Least time between two summaries.
        clock: Seconds, monotonic; tests pass a fake one.
    """

    def __init__(
        self,
        log: logging.Logger,
        *,
        interval_s: float = SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._next = -math.inf
        self.summaries = 0
        """Summaries logged so far."""

    def refused(self, reason: str) -> None:
        """Count one refused request; logs the summary when one is due. O(reasons)."""
        with self._lock:
            self._pending[reason] += 1
            counts = self._take_if_due()
        if counts:
            self._emit(counts)

    def flush(self, *, final: bool = False) -> None:
        """Log what is pending if a summary is due (or, with ``final``, at all)."""
        with self._lock:
            counts = self._take_if_due(final)
        if counts:
            self._emit(counts)

    def _take_if_due(self, final: bool = False) -> Counter[str]:
        if not self._pending or not (final or self._clock() >= self._next):
            return Counter()
        counts, self._pending = self._pending, Counter()
        self._next = self._clock() + self._interval_s
        return counts

    def _emit(self, counts: Counter[str]) -> None:
        self.summaries += 1
        by_reason = ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
        hints = "; ".join(HINTS[reason] for reason in counts if reason in HINTS)
        self._log.warning(
            "refused %d request(s) by reason: %s%s (the next summary after %.0f s at the "
            "earliest; ampscope_exporter_ingest_rejections_total counts every one)",
            sum(counts.values()),
            by_reason,
            f" ({hints})" if hints else "",
            self._interval_s,
        )
