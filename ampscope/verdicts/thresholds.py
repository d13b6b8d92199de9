"""The health rules' thresholds, validated once; the defaults are the alert rules'.

Built by the exporter from its settings and by ``ampscope status`` (defaults, or what the
exporters say they use); every rule reads its numbers here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ampscope.reporter.spike_rule import SpikeRule

_SPIKE = {
    "sigmas": "spike_sigmas",
    "window": "spike_window",
    "min_window": "spike_min_window",
    "ratio": "spike_ratio",
    "window_s": "spike_verdict_window_s",
}

REPORTED: dict[str, dict[str, str]] = {
    "scale_collapse": {
        "scale_floor": "scale_floor",
        "collapse_factor": "collapse_factor",
        "window_s": "collapse_window_s",
    },
    "skip_storm": {
        "ratio": "skip_storm_ratio",
        "window_s": "skip_storm_window_s",
        "min_steps": "skip_storm_min_steps",
    },
    "lost_rank": {"stale_after_s": "stale_after_s", "critical_share": "lost_critical_share"},
    "stalled_rank": {"stall_after_s": "stall_after_s", "pause_limit_s": "pause_limit_s"},
    "stopped_rank": {"grace_s": "stopped_grace_s", "critical_share": "lost_critical_share"},
    "inf_hotspot": {
        "share": "hotspot_share",
        "window_s": "hotspot_window_s",
        "min_detections": "hotspot_min_detections",
    },
    "loss_spike": _SPIKE,
    "grad_norm_spike": _SPIKE,
    "origin_outlier": {"factor": "origin_outlier_factor", "window_s": "spike_verdict_window_s"},
    "nonfinite_skipped": {"window_s": "nonfinite_skipped_window_s"},
    "transient_fault": {"window_s": "spike_verdict_window_s"},
    "reproducible_fault": {"window_s": "spike_verdict_window_s"},
}
"""Rule -> {the name its verdict reports a threshold under: the ``Thresholds`` field}. A rule
not listed reports none."""


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Health-rule thresholds; the defaults are the ones the Prometheus alert rules use."""

    scale_floor: float = 1.0
    """Scale collapse (critical): scale below this."""
    collapse_factor: float = 2.0**8
    """Scale collapse (critical): the window's peak scale / current scale at least this."""
    collapse_window_s: float = 600.0
    skip_storm_ratio: float = 0.25
    """Skip storm (warning): skipped / steps over the window above this."""
    skip_storm_window_s: float = 300.0
    skip_storm_min_steps: int = 10
    """Skip storm: fewer steps in the window say nothing."""
    stale_after_s: float = 60.0
    """Lost rank (warning): nothing heard for this long, and no final record."""
    stall_after_s: float = 600.0
    """Stalled rank (warning): heard from, but no new step for this long."""
    pause_limit_s: float = 7200.0
    """Stalled rank, for a rank whose heartbeats say it paused on purpose (a checkpoint
    save, an evaluation: ``paused()``): no new step for this long. Never shorter than
    ``stall_after_s`` (the larger of the two applies)."""
    lost_critical_share: float = 0.25
    """Lost rank turns critical when more than this share of the run's ranks are lost;
    stopped rank when more than this share of its world stopped alone."""
    stopped_grace_s: float = 300.0
    """Stopped rank (warning): a rank its launcher stopped (SIGTERM) stays stopped this long
    while ranks of its world still run. Long enough for an elastic restart (which stops every
    rank) to bring the id back; the stop is the rank's final report."""
    hotspot_share: float = 0.8
    """Inf hotspot (warning): one rank/device holds at least this share of detections."""
    hotspot_window_s: float = 600.0
    hotspot_min_detections: int = 5
    spike_sigmas: float = SpikeRule.sigmas
    """Loss/grad-norm spike (warning): the value stands more than this many standard
    deviations above the mean of the rank's preceding window."""
    spike_window: int = SpikeRule.window
    """Preceding (non-overflow) iterations the spike test compares against."""
    spike_min_window: int = SpikeRule.min_window
    """No spike before this many preceding iterations are known."""
    spike_ratio: float = SpikeRule.ratio
    """A spike is also at least this many times the window's median."""
    spike_verdict_window_s: float = 600.0
    """A spike verdict keeps firing while its newest spike is at most this old."""
    origin_outlier_factor: float = 10.0
    """Origin outlier (warning): a rank's own gradient norm exceeds this many times the
    median of the other ranks' at the same step."""

    nonfinite_skipped_window_s: float = 600.0
    """Non-finite skipped (warning): a watch under policy ``skip`` skipped a step for inf/NaN
    gradients within this window."""

    def reported(self, rule: str) -> dict[str, float | int]:
        """The thresholds ``rule``'s verdict reports (``Verdict.thresholds``)."""
        return {key: getattr(self, field) for key, field in REPORTED.get(rule, {}).items()}

    @classmethod
    def read_back(cls, verdicts: Iterable[Mapping[str, Any]]) -> Thresholds:
        """The thresholds that judged ``verdicts`` (exporters' JSON), from what each reports
        (the first verdict that gives a field wins); the defaults for the others.

        Raises:
            ValueError: the thresholds read back are not valid together.
        """
        given: dict[str, Any] = {}
        for verdict in verdicts:
            reported = verdict.get("thresholds") or {}
            for key, field in REPORTED.get(verdict.get("rule", ""), {}).items():
                if isinstance(reported.get(key), int | float):
                    given.setdefault(field, reported[key])
        return cls(**given)

    def spike_rule(self) -> SpikeRule:
        """The spike rule these thresholds describe."""
        return SpikeRule(
            sigmas=self.spike_sigmas,
            window=self.spike_window,
            min_window=self.spike_min_window,
            ratio=self.spike_ratio,
        )

    def __post_init__(self) -> None:
        self.spike_rule()  # raises ValueError on thresholds the rule refuses
        if not self.spike_verdict_window_s > 0:
            raise ValueError("spike_verdict_window_s must be positive")
        if not self.origin_outlier_factor > 1:
            raise ValueError("origin_outlier_factor must be > 1")
        for name in (
            "collapse_window_s",
            "skip_storm_window_s",
            "stale_after_s",
            "stall_after_s",
            "pause_limit_s",
            "stopped_grace_s",
            "nonfinite_skipped_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not self.hotspot_window_s > 0:
            raise ValueError("hotspot_window_s must be positive")
        if self.scale_floor < 0:
            raise ValueError("scale_floor must be >= 0")
        if not self.collapse_factor > 1:
            raise ValueError("collapse_factor must be > 1")
        if not 0 <= self.skip_storm_ratio <= 1:
            raise ValueError("skip_storm_ratio must be within [0, 1]")
        if not 0 < self.hotspot_share <= 1:
            raise ValueError("hotspot_share must be within (0, 1]")
        if self.skip_storm_min_steps < 1 or self.hotspot_min_detections < 1:
            raise ValueError("minimum counts must be at least 1")
