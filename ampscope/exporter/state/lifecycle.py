"""Rank states: running, stalled, lost, finished, failed or stopped, from what and when the
exporter heard.

One decision, read by the collector (``ampscope_rank_state``), the JSON API
(``RankView.state``) and the health rules, so they always agree; the states themselves are
named once in ``ampscope.verdicts.ranks``. Pure functions of a snapshot and the exporter's
clock: O(1) per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ampscope.exporter.state.ranks import RankSnapshot
from ampscope.verdicts.ranks import RankStateName


@dataclass(frozen=True, kw_only=True)
class Lifecycle:
    """The two clocks that tell the states apart.

    Args:
        stale_after_s: Nothing heard (records or heartbeats) for this long: lost.
        stall_after_s: Heard from, but no new step for this long: stalled.
    """

    stale_after_s: float
    stall_after_s: float

    def __post_init__(self) -> None:
        if not (self.stale_after_s > 0 and self.stall_after_s > 0):
            raise ValueError("stale_after_s and stall_after_s must be positive")

    def state(self, snap: RankSnapshot, now: float) -> RankStateName:
        """The rank's state at exporter time ``now``.

        A final record wins over everything: a rank that said goodbye is finished however
        long ago, failed when it said what its training ended on, or stopped when it said
        a signal stopped it (a failure wins: it is the fault). Then silence (lost), then a
        step that stopped advancing (stalled).
        """
        if snap.finished_at is not None:
            if snap.failure is not None:
                return "failed"
            return "stopped" if snap.stop_signal is not None else "finished"
        if not snap.reported_within(now, self.stale_after_s):
            return "lost"
        if now - snap.last_progress > self.stall_after_s:
            return "stalled"
        return "running"
