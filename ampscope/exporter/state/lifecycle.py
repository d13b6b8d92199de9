"""Rank states: running, stalled, lost, finished, failed or stopped, from what and when the
exporter heard (a paused rank is running until ``pause_limit_s``).

One decision, read by the collector (``ampscope_rank_state``), the JSON API
(``RankView.state``) and the health rules, so they always agree; the states themselves are
named once in ``ampscope.verdicts.ranks``. Pure functions of a snapshot and the exporter's
clock: O(1) per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ampscope.exporter.state.pauses import HeldPause
from ampscope.exporter.state.ranks import RankSnapshot
from ampscope.verdicts.ranks import RankStateName
from ampscope.verdicts.thresholds import Thresholds


@dataclass(frozen=True, kw_only=True)
class Lifecycle:
    """The two clocks that tell the states apart.

    Args:
        stale_after_s: Nothing heard (records or heartbeats) for this long: lost.
        stall_after_s: Heard from, but no new step for this long: stalled.
        pause_limit_s: The same for a rank whose heartbeats say it paused on purpose
            (``paused("checkpoint")``), counted from the earlier of its last step and the
            pause's start; the larger of it and ``stall_after_s`` applies.
    """

    stale_after_s: float
    stall_after_s: float
    pause_limit_s: float = Thresholds.pause_limit_s

    def __post_init__(self) -> None:
        if not (self.stale_after_s > 0 and self.stall_after_s > 0 and self.pause_limit_s > 0):
            raise ValueError("stale_after_s, stall_after_s and pause_limit_s must be positive")

    @classmethod
    def of(cls, t: Thresholds) -> Lifecycle:
        """The clocks of the health thresholds ``t``."""
        return cls(
            stale_after_s=t.stale_after_s,
            stall_after_s=t.stall_after_s,
            pause_limit_s=t.pause_limit_s,
        )

    def state(self, snap: RankSnapshot, now: float) -> RankStateName:
        """The rank's state at exporter time ``now``.

        A final record wins over everything: a rank that said goodbye is finished however
        long ago, failed when it said what its training ended on, or stopped when it said
        a signal stopped it (a failure wins: it is the fault). Then silence (lost), then a
        step that stopped advancing (stalled): for longer than ``stall_after_s``,
        or, while the rank says it paused, ``pause_limit_s``. A paused rank within its
        limit is ``running``: it is live and will step again, so every reader of the
        states (``ampscope_rank_state``, the alert rules, the run's state) counts it as
        one; its pause is a fact beside the state (``RankView.pause``). A pause does not
        hide a hang for good: past ``pause_limit_s`` the rank stalls as any other.
        """
        if snap.finished_at is not None:
            if snap.failure is not None:
                return "failed"
            return "stopped" if snap.stop_signal is not None else "finished"
        if not snap.reported_within(now, self.stale_after_s):
            return "lost"
        idle = now - snap.last_progress
        if idle <= self.stall_after_s:
            return "running"
        pause = self.pause_of(snap)
        if pause is None:
            return "stalled"
        # From the pause's own start when that is earlier: an exporter that restarted during
        # a pause heard its first step late, and grants no fresh pause_limit_s.
        since = min(snap.last_progress, pause.since)
        return "stalled" if now - since > self.pause_limit_s else "running"

    def pause_of(self, snap: RankSnapshot) -> HeldPause | None:
        """The rank's pause, unless it is a leftover: one that began before the rank's
        newest step (both on the rank's clock; by more than ``stale_after_s``, a slack for
        a pause opened within a step) is a pause the rank never ended (an exception past
        an integration's hooks, a ``paused()`` left open) and ignored, so that a new step
        ends a pause. O(1)."""
        pause = snap.pause
        if pause is None or pause.began < snap.newest.time - self.stale_after_s:
            return None
        return pause
