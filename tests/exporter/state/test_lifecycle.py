"""Rank states from what the exporter heard and when: the state function, the stalled and
lost verdicts, and a finished run's health."""

from __future__ import annotations

from ampscope.exporter.health import evaluate
from ampscope.exporter.state.lifecycle import Lifecycle
from ampscope.exporter.state.ranks import RankSnapshot, RankState
from ampscope.reporter.schema import Heartbeat, Identity, StepRecord
from ampscope.verdicts.thresholds import Thresholds
from exporter.factory import T0, record, totals

T = Thresholds(stale_after_s=60.0, stall_after_s=600.0)
LIFE = Lifecycle(stale_after_s=60.0, stall_after_s=600.0)


def beat(rank: int = 0, *, step: int, time: float, final: bool = False) -> Heartbeat:
    return Heartbeat(
        schema_version=1,
        identity=Identity(run="run-a", node="node0", rank=rank, local_rank=rank, world_size=2),
        time=time,
        step=step,
        final=final,
        dropped_records=0,
    )


def _state(events: list[tuple[float, list[StepRecord] | Heartbeat]]) -> RankState:
    state = RankState(history_length=64)
    for now, event in events:
        if isinstance(event, Heartbeat):
            state.heartbeat(event, now)
        else:
            state.apply_batch(event, 0, now)
    return state


def test_each_state_from_records_and_heartbeats() -> None:
    state = _state([(T0, [record(1), record(2)])])
    snap = state.snapshot()
    assert LIFE.state(snap, T0 + 59) == "running"
    assert LIFE.state(snap, T0 + 61) == "lost"
    # Heartbeats keep a rank that takes no step from being lost, but it stalls.
    for t in range(20, 700, 20):
        state.heartbeat(beat(step=2, time=T0 + t), T0 + t)
    snap = state.snapshot()
    assert (snap.last_report, snap.last_progress) == (T0 + 680, T0)
    assert LIFE.state(snap, T0 + 600) == "running"
    assert LIFE.state(snap, T0 + 601) == "stalled"
    # A new step: running again.
    state.apply_batch([record(3, time=T0 + 700)], 0, T0 + 700)
    assert LIFE.state(state.snapshot(), T0 + 700) == "running"
    # The final heartbeat: finished, however long ago, never lost.
    state.heartbeat(beat(step=3, time=T0 + 701, final=True), T0 + 701)
    snap = state.snapshot()
    assert snap.finished_at == T0 + 701
    assert LIFE.state(snap, T0 + 10_000) == "finished"
    # A restarted process (a new step after finishing) runs again.
    state.apply_batch([record(1, time=T0 + 800)], 0, T0 + 800)
    assert LIFE.state(state.snapshot(), T0 + 800) == "running"


def test_heartbeat_of_a_dead_process_is_ignored() -> None:
    state = _state([(T0, [record(5, time=T0 + 5)]), (T0 + 20, [record(1, time=T0 + 20)])])
    assert state.restarts == 1
    assert not state.heartbeat(beat(step=5, time=T0 + 6, final=True), T0 + 30)
    assert state.finished_at is None
    assert state.last_report == T0 + 20


def _stalled(rank: int, step: int, step_time: float) -> RankSnapshot:
    """A rank whose newest step arrived at T0, heartbeating until T0 + 700."""
    state = _state(
        [
            (T0, [record(step, rank=rank, time=step_time, total=totals(step))]),
            (T0 + 700, beat(rank, step=step, time=T0 + 700)),
        ]
    )
    return state.snapshot()


def _verdict(ranks: list[RankSnapshot], rule: str, now: float) -> dict:
    (verdict,) = [v for v in evaluate("run-a", ranks, now, T).verdicts if v.rule == rule]
    return verdict.model_dump()


def test_stalled_run_names_the_rank_with_the_lowest_step() -> None:
    ranks = [_stalled(0, 19, T0 - 1), _stalled(1, 12, T0 - 8), _stalled(2, 19, T0 - 1)]
    v = _verdict(ranks, "stalled_rank", T0 + 700)
    assert v["status"] == "warning"
    assert v["evidence"]["stalled"] == v["evidence"]["live"] == 3
    assert v["evidence"]["culprit"]["rank"] == 1
    assert "rank 1 (node node0) stopped first, at step 12: the likely culprit" in v["summary"]
    # At equal steps, the rank whose last step came first (on its own clock).
    ranks = [_stalled(0, 12, T0 - 1), _stalled(1, 12, T0 - 2)]
    assert _verdict(ranks, "stalled_rank", T0 + 700)["evidence"]["culprit"]["rank"] == 1


def test_one_stalled_rank_among_running_ones_names_no_culprit() -> None:
    running = _state([(T0 + 690, [record(30, rank=1)])]).snapshot()
    v = _verdict([_stalled(0, 12, T0), running], "stalled_rank", T0 + 700)
    assert v["status"] == "warning"
    assert (v["evidence"]["stalled"], v["evidence"]["live"]) == (1, 2)
    assert "culprit" not in v["evidence"]
    assert _verdict([running], "stalled_rank", T0 + 700)["status"] == "ok"


def test_finished_run_is_judged_as_it_ended() -> None:
    clean = [
        _state(
            [
                (T0, [record(1, rank=r), record(2, rank=r)]),
                (T0 + 1, beat(r, step=2, time=T0 + 1, final=True)),
            ]
        ).snapshot()
        for r in (0, 1)
    ]
    # Hours later: no rank lost or stalled, every rule ok.
    report = evaluate("run-a", clean, T0 + 7200, T)
    assert (report.status, report.state) == ("ok", "finished")
    assert report.states == {"running": 0, "stalled": 0, "lost": 0, "finished": 2}
    assert {v.status for v in report.verdicts} == {"ok"}
    # A run that ended with a collapsed scale says so, as of its end, for as long as it is held.
    collapsed = _state(
        [
            (T0, [record(1, scale=65536.0), record(2, scale=0.5, scale_before=65536.0)]),
            (T0 + 1, beat(step=2, time=T0 + 1, final=True)),
        ]
    ).snapshot()
    for now in (T0 + 2, T0 + 7200):
        report = evaluate("run-a", [collapsed], now, T)
        assert (report.status, report.state) == ("critical", "finished")
        statuses = {v.rule: v.status for v in report.verdicts}
        assert statuses["scale_collapse"] == "critical"
        assert statuses["lost_rank"] == statuses["stalled_rank"] == "ok"
