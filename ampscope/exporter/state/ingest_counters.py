"""The exporter's own ingest counters (served as ``ampscope_exporter_*`` families)."""

from __future__ import annotations

import threading

from ampscope.exporter.state.refusals import RefusalLog

REJECTION_REASONS = (
    # Bearer token: a rank without one is misconfigured; a wrong one may be an attacker.
    "token_missing",
    "token_wrong",
    "too_large",
    "malformed",
    "invalid",
    "cardinality",
    "clock_skew",
    "identity_conflict",
    # Transport: the server cut the request (ampscope.exporter.http.server, .body).
    "header_timeout",
    "body_timeout",
    "busy",
    "over_capacity",
    "client_disconnect",
    "client_san",
)
"""Every reason a request is rejected for; all are exposed from start-up at 0. Transport
reasons count requests to any endpoint (a header timeout happens before the path is
known)."""


class IngestStats:
    """Thread-safe counters of accepted and rejected ingest requests.

    Args:
        refusals: Told of every rejection too, to log a summary by reason; ``None``: counted
            only.
    """

    def __init__(self, refusals: RefusalLog | None = None) -> None:
        self.refusals = refusals
        self._lock = threading.Lock()
        self.batches = 0
        self.records = 0
        self._rejections = dict.fromkeys(REJECTION_REASONS, 0)

    def accepted(self, records: int) -> None:
        """Count one accepted batch of ``records`` records. O(1)."""
        with self._lock:
            self.batches += 1
            self.records += records

    def rejected(self, reason: str) -> None:
        """Count one rejected request; ``reason`` must be one of ``REJECTION_REASONS``."""
        with self._lock:
            self._rejections[reason] += 1
        if self.refusals is not None:
            self.refusals.refused(reason)

    def rejections(self) -> dict[str, int]:
        """A copy of the rejection counts by reason."""
        with self._lock:
            return dict(self._rejections)
