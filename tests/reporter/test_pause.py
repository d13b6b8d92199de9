"""A rank's pauses (``ampscope.paused``, the front-ends' ``paused()``): what the heartbeat
thread reads of them, and the heartbeats that carry them to an exporter, old or new."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from loopback_server import LoopbackExporter, make_record
from support import DEADLOCK_GUARD_S

import ampscope
from ampscope.reporter import pause
from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import Heartbeat, RankPause

FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0, "flush_interval": 0.05}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pause module's monotonic clock, moved by hand: ``clock[0] += 5``."""
    now = [1000.0]
    monkeypatch.setattr(pause, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_pauses_nest_saying_the_newest_reason_and_the_oldest_age(clock: list[float]) -> None:
    assert pause.current() is None
    with ampscope.paused("eval") as evaluation:
        clock[0] += 30
        assert pause.current() == pause.PauseNow(reason="eval", seconds=30.0)
        with pause.paused("checkpoint"):
            clock[0] += 10
            # The rank took no step since the evaluation began.
            assert pause.current() == pause.PauseNow(reason="checkpoint", seconds=40.0)
        assert pause.current() == pause.PauseNow(reason="eval", seconds=40.0)
        assert evaluation.open
    assert not evaluation.open
    assert pause.current() is None


def test_a_pause_ends_once_from_any_thread(clock: list[float]) -> None:
    # A start and an end in two callbacks, perhaps two threads; ending twice is harmless.
    saving = pause.paused("checkpoint")
    other = pause.paused("eval")
    ender = threading.Thread(target=saving.end)
    ender.start()
    ender.join(DEADLOCK_GUARD_S)
    saving.end()
    assert pause.current() == pause.PauseNow(reason="eval", seconds=0.0)
    other.end()
    other.end()
    assert pause.current() is None


def test_a_reason_becomes_a_short_label_and_never_raises() -> None:
    assert pause.reason_label("checkpoint") == "checkpoint"
    assert pause.reason_label("end of training") == "end-of-training"
    assert pause.reason_label("<b>eval</b>") == "b-eval-/b"
    assert pause.reason_label("") == "pause"
    assert pause.reason_label(3) == "3"
    assert len(pause.reason_label("x" * 500)) == pause.MAX_REASON_LENGTH


def _beats_with(exporter: LoopbackExporter, reason: str | None) -> int:
    return sum(
        1
        for beat in exporter.heartbeats
        if not beat.final and (beat.pause.reason if beat.pause else None) == reason
    )


def test_heartbeats_carry_the_open_pause_and_stop_saying_it_when_it_ends() -> None:
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.05
        reporter = HttpReporter(exporter.url, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            assert exporter.wait_until(lambda: _beats_with(exporter, None) >= 1)
            with ampscope.paused("checkpoint"):
                assert exporter.wait_until(lambda: _beats_with(exporter, "checkpoint") >= 2)
            unpaused = _beats_with(exporter, None)
            assert exporter.wait_until(lambda: _beats_with(exporter, None) > unpaused)
        finally:
            reporter.close()
        said = [beat.pause for beat in exporter.heartbeats if beat.pause is not None]
        assert said[-1].seconds >= said[0].seconds  # the age of one pause, on its clock
        assert exporter.heartbeats[-1].final
        assert exporter.heartbeats[-1].pause is None


def test_an_exporter_that_predates_pauses_gets_heartbeats_without_them(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="ampscope")
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.05
        exporter.unknown_heartbeat_fields = {"pause"}
        reporter = HttpReporter(exporter.url, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            # Plain heartbeats leave the field out: the old exporter takes them.
            assert exporter.wait_until(lambda: "beat" in exporter.events)
            with ampscope.paused("checkpoint"):
                assert exporter.wait_until(lambda: exporter.events.count("beat") >= 4)
        finally:
            reporter.close()
        # Refused once, sent again without the pause; never said again (refused once only).
        assert exporter.events.count("refused") == 1
        beats = exporter.events[exporter.events.index("refused") + 1 :]
        assert beats[0] == "beat"
        assert all(beat.pause is None for beat in exporter.heartbeats)
        assert exporter.events[-1] == "final"
    (warning,) = [r.getMessage() for r in caplog.records if "says a pause" in r.getMessage()]
    assert "an older exporter?" in warning


# An exporter of the release before pauses knows stop_signal; one older still, neither.
OLDER_EXPORTERS = [{"pause"}, {"pause", "stop_signal"}]


@pytest.mark.parametrize("unknown", OLDER_EXPORTERS)
def test_a_paused_rank_then_stopped_is_heard_by_an_older_exporter(unknown: set[str]) -> None:
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.05
        exporter.unknown_heartbeat_fields = unknown
        reporter = HttpReporter(exporter.url, sigterm_handler=False, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            with ampscope.paused("checkpoint"):
                assert exporter.wait_until(lambda: exporter.events.count("beat") >= 3)
                reporter._pipeline.note_stop(signal.SIGTERM)  # a preemption mid-save
        finally:
            reporter.close(timeout=DEADLOCK_GUARD_S)
        # Each field refused once; every heartbeat taken, none saying a pause.
        assert exporter.events.count("refused") == len(unknown)
        assert all(beat.pause is None for beat in exporter.heartbeats)
        (final,) = [beat for beat in exporter.heartbeats if beat.final]
        assert final.stop_signal == (None if "stop_signal" in unknown else signal.SIGTERM)
        assert exporter.events[-1] == "final"


@pytest.mark.parametrize("unknown", [set(), *OLDER_EXPORTERS])
def test_a_heartbeat_saying_both_goes_without_what_the_exporter_refuses(
    unknown: set[str],
) -> None:
    # The pipeline puts a pause on live heartbeats and a stop_signal on final ones; the
    # fallback itself takes a heartbeat holding both, dropping the newest field first.
    with LoopbackExporter() as exporter:
        exporter.unknown_heartbeat_fields = unknown
        reporter = HttpReporter(exporter.url, sigterm_handler=False, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            beat = Heartbeat(
                schema_version=1,
                identity=make_record(1).identity,
                time=time.time(),
                step=1,
                final=True,
                dropped_records=0,
                stop_signal=signal.SIGTERM,
                pause=RankPause(reason="checkpoint", seconds=5.0),
            )
            before = len(exporter.heartbeat_bodies)
            result = reporter._pipeline._post_taken(beat)
            bodies = exporter.heartbeat_bodies[before:]
        finally:
            reporter.close(timeout=DEADLOCK_GUARD_S)
    sent = [set(json.loads(body)) & {"pause", "stop_signal"} for body in bodies]
    assert result is not None
    assert result.applied is True
    assert sent[0] == {"pause", "stop_signal"}
    assert sent[-1] == {"pause", "stop_signal"} - unknown  # the one taken
    assert len(sent) == 1 + len(unknown)
    # Noted refused only when the heartbeat without the pause was taken: refused again
    # (for its stop_signal too), the pause is not known to be the cause, so it is tried again.
    assert reporter._pipeline.pause_refused is (unknown == {"pause"})


def test_a_pause_is_not_given_up_when_the_heartbeat_is_refused_without_it() -> None:
    # The exporter refuses every heartbeat for something else (here its step): the retry
    # without the pause is refused too, so the pause was not the cause and later heartbeats
    # still say it.
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.05
        reporter = HttpReporter(exporter.url, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            exporter.unknown_heartbeat_fields = {"step"}
            with ampscope.paused("checkpoint"):
                assert exporter.wait_until(lambda: exporter.events.count("refused") >= 4)
                assert not reporter._pipeline.pause_refused
                bodies = list(exporter.heartbeat_bodies)
        finally:
            reporter.close(timeout=DEADLOCK_GUARD_S)
    said = [json.loads(body).get("pause") for body in bodies]
    assert sum(1 for p in said if p is not None) >= 2  # said again after a refused retry
