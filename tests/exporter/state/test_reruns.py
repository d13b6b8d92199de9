"""A rank's rerun counters: only its own flagged results count, a new process starts afresh."""

from __future__ import annotations

from ampscope.exporter.state.reruns import RankReruns, RerunCounts, device_offended
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


def test_a_reproduced_result_keeps_its_origin_detections_off_the_device() -> None:
    reruns = RankReruns()
    own = {"cuda:0": True, "cuda:1": True}
    reproduced = record(2, rerun=_rerun(flagged=True, reproduced=True)).model_copy(
        update={"found_inf_origin": own}
    )
    transient = record(3, rerun=_rerun(flagged=True, reproduced=False))
    plain = record(4, origin=True)
    for step in (reproduced, transient, plain):
        reruns.observe(step, 10.0)
    # Both devices of the reproduced step held inf/NaN again on the rerun: the data's.
    assert reruns.data_origins == 2
    assert [device_offended(r) for r in (record(1), reproduced, transient, plain)] == [
        False,
        False,
        True,
        True,
    ]
    # Another rank's flagged iteration that this rank only reran is not about this rank.
    assert not device_offended(record(5, rerun=_rerun(flagged=False, reproduced=True)))
    reruns.reset()
    assert reruns.data_origins == 0


def test_a_scaler_overflow_the_rerun_reproduced_is_no_result() -> None:
    """The fault rule's ``edge`` weather after a rerun: the gradients outgrew a scale that
    trained cleanly. Neither a reproducible fault (no bad data) nor a transient one."""
    from ampscope.reporter.schema import NonfiniteCall

    reruns = RankReruns()
    edge = NonfiniteCall(kind="weather", reason="edge", own=True, clean_scale=8.0)
    outgrew = record(2, rerun=_rerun(flagged=True, reproduced=True)).model_copy(
        update={"nonfinite": edge}
    )
    nan_loss = NonfiniteCall(kind="fault", reason="reproducible", own=True, clean_scale=8.0)
    sample = record(3, rerun=_rerun(flagged=True, reproduced=True)).model_copy(
        update={"nonfinite": nan_loss}
    )
    reruns.observe(outgrew, 10.0)
    assert reruns.counts == RerunCounts()
    assert not device_offended(outgrew)
    reruns.observe(sample, 11.0)
    assert reruns.counts == RerunCounts(reproducible=1)
