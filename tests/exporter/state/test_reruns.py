"""A rank's rerun counters: only its own flagged results count, a new process starts afresh."""

from __future__ import annotations

from ampscope.exporter.state.reruns import RankReruns, RerunCounts
from ampscope.reporter.schema import Rerun, RerunPass
from exporter.factory import record


def _rerun(*, flagged: bool, reproduced: bool) -> Rerun:
    return Rerun(
        reason="nonfinite",
        flagged=flagged,
        reproduced=reproduced,
        first=RerunPass(loss=1.0, norm=None, nonfinite=flagged),
        second=RerunPass(loss=1.0, norm=2.0, nonfinite=flagged and reproduced),
    )


def test_counts_only_the_ranks_own_flagged_results() -> None:
    reruns = RankReruns()
    reruns.observe(record(1), 10.0)
    reruns.observe(record(2, rerun=_rerun(flagged=False, reproduced=True)), 11.0)
    reruns.observe(record(3, rerun=_rerun(flagged=True, reproduced=False)), 12.0)
    reruns.observe(record(4, rerun=_rerun(flagged=True, reproduced=True)), 13.0)
    reruns.observe(record(5, rerun=_rerun(flagged=True, reproduced=True)), 14.0)
    assert reruns.counts == RerunCounts(transient=1, reproducible=2)
    assert [(e.step, e.result, e.received) for e in reruns.recent] == [
        (3, "transient", 12.0),
        (4, "reproducible", 13.0),
        (5, "reproducible", 14.0),
    ]
    assert reruns.recent[0].first_norm is None
    assert reruns.recent[0].second_norm == 2.0
    reruns.reset()
    assert reruns.counts == RerunCounts()
    assert not reruns.recent
