"""A rank's pause as the exporter holds it: what its newest heartbeat said.

A rank that stops stepping on purpose (``paused("checkpoint")`` on the rank side) says so in
its heartbeats; the lifecycle then allows it ``pause_limit_s`` instead of ``stall_after_s``
without a step. The pause lasts until a heartbeat without one, or a new step; the lifecycle
ignores one that began before the rank's newest step (a leftover, ``Lifecycle.pause_of``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ampscope.reporter.schema import RankPause


@dataclass(frozen=True, kw_only=True)
class HeldPause:
    """A pause a rank's heartbeat said, on the exporter's clock."""

    reason: str
    since: float
    """Exporter clock when the pause began: the heartbeat's arrival less the seconds the
    rank said it has been paused (the first heartbeat's word, kept while the reason holds,
    so a late heartbeat does not move it)."""
    began: float
    """When the pause began on the rank's wall clock (the heartbeat's ``time`` less the
    seconds it said): compared with the rank's own step times, free of transit delays (a
    batch of records delivered late) and of the clocks' offset."""

    def seconds(self, now: float) -> float:
        """How long the rank has been paused at exporter time ``now``."""
        return max(0.0, now - self.since)


def pause_after(
    said: RankPause | None, now: float, sent: float, before: HeldPause | None
) -> HeldPause | None:
    """The pause to hold after a heartbeat sent at rank time ``sent`` that said ``said``,
    received at exporter time ``now``, the rank holding ``before``. O(1)."""
    if said is None:
        return None
    if before is not None and before.reason == said.reason:
        return before
    return HeldPause(reason=said.reason, since=now - said.seconds, began=sent - said.seconds)
