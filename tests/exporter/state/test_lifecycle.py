"""Rank states from what the exporter heard and when: the state function, the stalled and
lost verdicts, and a finished run's health."""

from __future__ import annotations

from ampscope.exporter.health import evaluate
from ampscope.exporter.state.lifecycle import Lifecycle
from ampscope.exporter.state.ranks import RankSnapshot, RankState
from ampscope.reporter.schema import Heartbeat, Identity, RankFailure, RankPause, StepRecord
from ampscope.verdicts.thresholds import Thresholds
from exporter.factory import T0, record, totals

T = Thresholds(stale_after_s=60.0, stall_after_s=600.0)
LIFE = Lifecycle(stale_after_s=60.0, stall_after_s=600.0)


def beat(
    rank: int = 0,
    *,
    step: int,
    time: float,
    final: bool = False,
    failure: RankFailure | None = None,
    stop_signal: int | None = None,
    pause: RankPause | None = None,
) -> Heartbeat:
    return Heartbeat(
        schema_version=1,
        identity=Identity(run="run-a", node="node0", rank=rank, local_rank=rank, world_size=2),
        time=time,
        step=step,
        final=final,
        dropped_records=0,
        failure=failure,
        stop_signal=stop_signal,
        pause=pause,
    )


def stopped(step: int, origin: list[int] | None) -> RankFailure:
    """What a rank's final heartbeat says when a GradWatch raised at ``step``."""
    return RankFailure(
        kind="nonfinite_gradients",
        exception="NonFiniteGradientsError",
        message=f"ampscope: non-finite gradients at step {step}: policy 'raise' stops",
        step=step,
        origin_ranks=origin,
        seen_by="uncaught",
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
    assert report.states == {
        "running": 0,
        "stalled": 0,
        "lost": 0,
        "finished": 2,
        "failed": 0,
        "stopped": 0,
    }
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


def test_a_final_heartbeat_with_a_failure_ends_the_rank_failed() -> None:
    state = _state([(T0, [record(1), record(2)])])
    state.heartbeat(beat(step=2, time=T0 + 1, final=True, failure=stopped(2, [0])), T0 + 1)
    snap = state.snapshot()
    assert (snap.finished_at, snap.failure) == (T0 + 1, stopped(2, [0]))
    assert LIFE.state(snap, T0 + 1) == "failed"
    assert LIFE.state(snap, T0 + 10_000) == "failed"  # never lost, however long ago
    # A plain final heartbeat after it (a resend) does not make it finished.
    state.heartbeat(beat(step=2, time=T0 + 2, final=True), T0 + 2)
    assert LIFE.state(state.snapshot(), T0 + 3) == "failed"
    # A restarted process (an elastic restart) runs again, its failure gone.
    state.apply_batch([record(1, time=T0 + 800)], 0, T0 + 800)
    snap = state.snapshot()
    assert (LIFE.state(snap, T0 + 800), snap.failure) == ("running", None)


def test_a_failure_after_the_rank_said_it_finished_makes_it_failed() -> None:
    # ``try: ... finally: watch.close()``: the close says finished, then the exception
    # reaches the process's hook and the reporter tells the exporter again.
    state = _state([(T0, [record(1), record(2)]), (T0 + 1, beat(step=2, time=T0 + 1, final=True))])
    assert LIFE.state(state.snapshot(), T0 + 1) == "finished"
    state.heartbeat(beat(step=2, time=T0 + 2, final=True, failure=stopped(2, None)), T0 + 2)
    snap = state.snapshot()
    assert LIFE.state(snap, T0 + 2) == "failed"
    assert snap.finished_at == T0 + 1  # it ended when it first said so


def test_a_run_whose_ranks_failed_is_critical_and_failed_for_as_long_as_it_is_held() -> None:
    ranks = [
        _state(
            [
                (T0, [record(s, rank=r) for s in range(1, 6)]),
                (T0 + 1, beat(r, step=5, time=T0 + 1, final=True, failure=stopped(5, [1]))),
            ]
        ).snapshot()
        for r in (0, 1)
    ]
    for now in (T0 + 2, T0 + 7200):
        report = evaluate("run-a", ranks, now, T)
        assert (report.status, report.state) == ("critical", "failed")
        assert report.states == {
            "running": 0,
            "stalled": 0,
            "lost": 0,
            "finished": 0,
            "failed": 2,
            "stopped": 0,
        }
        verdicts = {v.rule: v for v in report.verdicts}
        failed = verdicts["rank_failed"]
        assert failed.status == "critical"
        assert failed.evidence["step"] == 5
        assert failed.evidence["exception"] == "NonFiniteGradientsError"
        assert failed.evidence["origin_ranks"] == [1]
        assert [r["rank"] for r in failed.evidence["ranks"]] == [0, 1]
        assert failed.summary == (
            "2 of 2 rank(s) failed (rank(s) 0, 1): training stopped on inf/NaN gradients at "
            "step 5 (NonFiniteGradientsError); origin rank(s) 1"
        )
        # Every rank ended: nothing is lost or stalled.
        assert verdicts["lost_rank"].status == verdicts["stalled_rank"].status == "ok"
        assert verdicts["stalled_rank"].summary == "no live ranks: 2 failed"
    # One rank finished, the other failed: the run failed all the same.
    finished = _state(
        [(T0, [record(1, rank=1)]), (T0 + 1, beat(1, step=1, time=T0 + 1, final=True))]
    ).snapshot()
    report = evaluate("run-a", [ranks[0], finished], T0 + 2, T)
    assert (report.status, report.state) == ("critical", "failed")
    assert report.states["finished"] == report.states["failed"] == 1


SIGTERM = 15


def test_a_final_heartbeat_with_a_stop_signal_ends_the_rank_stopped() -> None:
    state = _state([(T0, [record(1), record(2)])])
    state.heartbeat(beat(step=2, time=T0 + 1, final=True, stop_signal=SIGTERM), T0 + 1)
    snap = state.snapshot()
    assert (snap.finished_at, snap.stop_signal, snap.failure) == (T0 + 1, SIGTERM, None)
    assert LIFE.state(snap, T0 + 1) == "stopped"
    assert LIFE.state(snap, T0 + 10_000) == "stopped"  # said goodbye: never lost
    # The next elastic generation of the same rank id, a new process: running again.
    state.apply_batch([record(1, time=T0 + 30)], 0, T0 + 30)
    snap = state.snapshot()
    assert (LIFE.state(snap, T0 + 30), snap.stop_signal, snap.finished_at) == (
        "running",
        None,
        None,
    )
    assert snap.restarts == 1
    # Then it finishes by itself: finished, not stopped.
    state.heartbeat(beat(step=1, time=T0 + 31, final=True), T0 + 31)
    assert LIFE.state(state.snapshot(), T0 + 31) == "finished"


def test_a_failure_wins_over_a_stop_signal() -> None:
    state = _state([(T0, [record(1), record(2)])])
    told = stopped(2, None)
    state.heartbeat(
        beat(step=2, time=T0 + 1, final=True, failure=told, stop_signal=SIGTERM), T0 + 1
    )
    assert LIFE.state(state.snapshot(), T0 + 1) == "failed"


def test_a_run_its_launcher_stopped_pages_nobody_and_reads_stopped() -> None:
    ranks = [
        _state(
            [
                (T0, [record(1, rank=r), record(2, rank=r)]),
                (T0 + 1, beat(r, step=2, time=T0 + 1, final=True, stop_signal=SIGTERM)),
            ]
        ).snapshot()
        for r in (0, 1)
    ]
    # Hours after the stop, past every stale TTL: nothing lost, every rule ok.
    report = evaluate("run-a", ranks, T0 + 7200, T)
    assert (report.status, report.state) == ("ok", "stopped")
    assert report.states["stopped"] == 2
    verdicts = {v.rule: v for v in report.verdicts}
    assert verdicts["lost_rank"].status == "ok"
    assert verdicts["stalled_rank"].summary == "no live ranks: 2 stopped"
    # The same ranks without the goodbye (SIGKILL, a dead node): lost, critical.
    silent = [_state([(T0, [record(1, rank=r), record(2, rank=r)])]).snapshot() for r in (0, 1)]
    report = evaluate("run-a", silent, T0 + 7200, T)
    lost = {v.rule: v for v in report.verdicts}["lost_rank"]
    assert (report.state, lost.status, lost.evidence["lost"]) == ("active", "critical", 2)


def _checkpointing(rank: int = 0, *, paused: bool = True, until: int = 700) -> RankState:
    """A rank whose step 12 arrived at T0, then heartbeating every 20 s until T0 + ``until``,
    each heartbeat saying a checkpoint save began at T0 + 1 (or, not ``paused``, nothing)."""
    events: list[tuple[float, list[StepRecord] | Heartbeat]] = [
        (T0, [record(12, rank=rank, time=T0, total=totals(12))])
    ]
    for t in range(20, until + 1, 20):
        said = RankPause(reason="checkpoint", seconds=t - 1.0) if paused else None
        events.append((T0 + t, beat(rank, step=12, time=T0 + t, pause=said)))
    return _state(events)


def test_a_rank_paused_on_purpose_is_running_past_the_stall_limit_and_says_why() -> None:
    snap = _checkpointing().snapshot()
    assert snap.pause is not None
    assert snap.pause.reason == "checkpoint"
    assert snap.pause.seconds(T0 + 700) == 699.0
    assert LIFE.state(snap, T0 + 700) == "running"
    v = _verdict([snap], "stalled_rank", T0 + 700)
    assert v["status"] == "ok"
    assert v["summary"] == (
        "1 of 1 live rank(s) paused on purpose, within pause_limit_s 7200 s: rank 0 "
        "(node node0) paused (checkpoint) for 699 s"
    )
    assert v["evidence"]["paused_ranks"] == [
        {
            "rank": 0,
            "node": "node0",
            "last_step": 12,
            "pause": {"reason": "checkpoint", "seconds": 699.0},
        }
    ]
    assert v["thresholds"] == {"stall_after_s": 600.0, "pause_limit_s": 7200.0}


def test_the_same_rank_not_paused_stalls_every_rank_as_a_hang_does() -> None:
    # What AmpscopeRankStalled exists for: heartbeats flow, no step, nothing said.
    ranks = [_checkpointing(r, paused=False).snapshot() for r in (0, 1)]
    assert [LIFE.state(snap, T0 + 700) for snap in ranks] == ["stalled", "stalled"]
    v = _verdict(ranks, "stalled_rank", T0 + 700)
    assert v["status"] == "warning"
    assert "every live rank stalled (a hang?)" in v["summary"]


def test_a_pause_past_pause_limit_s_stalls_again() -> None:
    life = Lifecycle(stale_after_s=60.0, stall_after_s=600.0, pause_limit_s=1800.0)
    t = Thresholds(stale_after_s=60.0, stall_after_s=600.0, pause_limit_s=1800.0)
    snap = _checkpointing(until=2000).snapshot()
    assert life.state(snap, T0 + 1800) == "running"
    assert life.state(snap, T0 + 1801) == "stalled"
    (v,) = [v for v in evaluate("run-a", [snap], T0 + 2000, t).verdicts if v.rule == "stalled_rank"]
    assert v.status == "warning"
    assert (
        "(1 of them paused past pause_limit_s 1800 s: rank 0 paused (checkpoint) for 1999 s)"
        in (v.summary)
    )
    assert v.evidence["ranks"][0]["pause"] == {"reason": "checkpoint", "seconds": 1999.0}
    # A pause never shortens the stall limit: a limit below stall_after_s means stall_after_s.
    short = Lifecycle(stale_after_s=60.0, stall_after_s=600.0, pause_limit_s=60.0)
    assert short.state(_checkpointing(until=500).snapshot(), T0 + 500) == "running"


def test_a_pause_ends_with_a_heartbeat_without_one_or_a_new_step() -> None:
    state = _checkpointing()
    state.heartbeat(beat(step=12, time=T0 + 720), T0 + 720)  # the save returned
    snap = state.snapshot()
    assert snap.pause is None
    assert LIFE.state(snap, T0 + 720) == "stalled"  # and no step since: a stall again
    state = _checkpointing()
    state.apply_batch([record(13, time=T0 + 710, total=totals(13))], 0, T0 + 710)
    assert state.snapshot().pause is None
    # A final heartbeat says no pause: the rank finished.
    state = _checkpointing()
    said = RankPause(reason="checkpoint", seconds=720.0)
    state.heartbeat(beat(step=12, time=T0 + 721, final=True, pause=said), T0 + 721)
    assert state.snapshot().pause is None


def test_a_pause_keeps_its_start_while_its_reason_holds() -> None:
    # Heartbeats arriving late do not move the start; a new reason starts a new pause.
    state = _checkpointing(until=100)
    late = RankPause(reason="checkpoint", seconds=100.0)
    state.heartbeat(beat(step=12, time=T0 + 140, pause=late), T0 + 140)
    snap = state.snapshot()
    assert snap.pause is not None
    assert snap.pause.since == T0 + 1
    evaluation = RankPause(reason="eval", seconds=5.0)
    state.heartbeat(beat(step=12, time=T0 + 160, pause=evaluation), T0 + 160)
    snap = state.snapshot()
    assert snap.pause is not None
    assert (snap.pause.reason, snap.pause.since) == ("eval", T0 + 155)


def test_a_final_record_and_silence_win_over_a_pause() -> None:
    # Stopped during a checkpoint save (a preemption): the goodbye says stopped, however
    # long the pause had run, and ends the pause.
    state = _checkpointing()
    state.heartbeat(beat(step=12, time=T0 + 710, final=True, stop_signal=SIGTERM), T0 + 710)
    snap = state.snapshot()
    assert (LIFE.state(snap, T0 + 710), snap.pause) == ("stopped", None)
    # A paused rank that falls silent (a dead node mid-save) is lost, not running.
    snap = _checkpointing().snapshot()
    assert snap.pause is not None
    assert LIFE.state(snap, T0 + 700 + 61) == "lost"


def test_a_pause_the_rank_never_ended_is_ignored_once_it_steps_again() -> None:
    # A pause opened at T0 + 1 and never ended (an exception past an integration's hooks);
    # the rank steps on at T0 + 100 and T0 + 200, then hangs, its heartbeats still saying
    # the old pause: a new step ended it, so the hang stalls after stall_after_s.
    events: list[tuple[float, list[StepRecord] | Heartbeat]] = [
        (T0, [record(12, time=T0, total=totals(12))]),
        (T0 + 100, [record(13, time=T0 + 100, total=totals(13))]),
        (T0 + 200, [record(14, time=T0 + 200, total=totals(14))]),
    ]
    for t in range(220, 901, 20):
        said = RankPause(reason="eval", seconds=t - 1.0)
        events.append((T0 + t, beat(step=14, time=T0 + t, pause=said)))
    snap = _state(events).snapshot()
    assert snap.pause is not None  # held as said; the lifecycle reads it as a leftover
    assert LIFE.pause_of(snap) is None
    assert LIFE.state(snap, T0 + 900) == "stalled"
    v = _verdict([snap], "stalled_rank", T0 + 900)
    assert v["status"] == "warning"


def test_a_pause_that_began_after_the_newest_step_still_holds_the_rank() -> None:
    # The leftover rule spares a pause opened after the step (within the slack too).
    snap = _checkpointing(until=900).snapshot()
    assert LIFE.pause_of(snap) is not None
    assert LIFE.state(snap, T0 + 900) == "running"


def test_an_exporter_restarted_during_a_pause_grants_no_fresh_pause_limit() -> None:
    # The rank took step 12 at T0 - 7010 and paused at T0 - 7000 (its heartbeats say so);
    # this exporter started at T0 and heard that step then (delivered late: no leftover, as
    # the pause began after the step on the rank's clock). Its limit runs from the pause's
    # start: stalled past T0 + 200, not T0 + 7200; running before.
    events: list[tuple[float, list[StepRecord] | Heartbeat]] = [
        (T0, [record(12, time=T0 - 7010, total=totals(12))])
    ]
    for t in range(20, 801, 20):
        said = RankPause(reason="checkpoint", seconds=7000.0 + t)
        events.append((T0 + t, beat(step=12, time=T0 + t, pause=said)))
    snap = _state(events).snapshot()
    assert LIFE.pause_of(snap) is not None
    assert LIFE.state(snap, T0 + 100) == "running"
    assert LIFE.state(snap, T0 + 800) == "stalled"
