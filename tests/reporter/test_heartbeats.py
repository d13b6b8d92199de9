"""Heartbeats while a rank sends no records, the final record on close, and what a rank
says when it cannot deliver: HttpReporter against the loopback exporter."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from loopback_server import LoopbackExporter, make_record
from support import DEADLOCK_GUARD_S, free_port

from ampscope.reporter import pipeline
from ampscope.reporter.http import HttpReporter

FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0, "flush_interval": 0.05}


class SteeredClock:
    """The reporter pipeline's ``time.monotonic``: the real clock until frozen, then moved
    by hand only, so that what is due when does not depend on the machine's speed."""

    def __init__(self) -> None:
        self.frozen_at: float | None = None

    def __call__(self) -> float:
        return time.monotonic() if self.frozen_at is None else self.frozen_at

    def freeze(self) -> None:
        self.frozen_at = time.monotonic()

    def advance(self, seconds: float) -> None:
        assert self.frozen_at is not None
        self.frozen_at += seconds

    def thaw(self) -> None:
        self.frozen_at = None


def test_idle_rank_beats_as_often_as_the_exporter_asks_then_says_goodbye(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = SteeredClock()
    monkeypatch.setattr(pipeline, "time", SimpleNamespace(monotonic=clock, time=time.time))
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.1  # a quarter of a 0.4 s --stale-after
        reporter = HttpReporter(exporter.url, heartbeat_interval=30.0, **FAST)
        try:
            assert not exporter.wait_until(
                lambda: exporter.heartbeats, timeout=0.3
            )  # no record yet
            reporter.emit(make_record(1))
            reporter.emit(make_record(2))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            # Idle from here on: heartbeats every 0.1 s as asked, not the configured 30 s
            # (at 30 s, 5 beats would take longer than the guard).
            assert exporter.wait_until(lambda: len(exporter.heartbeats) >= 5)
            assert reporter._pipeline.heartbeat_interval == 0.1
            assert not any(beat.final for beat in exporter.heartbeats)
            beat = exporter.heartbeats[-1]
            assert (beat.identity.run, beat.identity.rank, beat.step) == ("run-a", 0, 2)
            # Records flowing again replace heartbeats: one record per 0.06 s of the
            # reporter's clock, 1.6 s in all, and never 0.1 s without one.
            clock.freeze()
            before = len(exporter.heartbeats)
            for step in range(3, 30):
                clock.advance(0.06)
                reporter.emit(make_record(step))
                assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            assert len(exporter.heartbeats) - before <= 1  # one may have been due at freeze
        finally:
            clock.thaw()
            reporter.close()
        assert exporter.events[-1] == "final"
        assert exporter.events.count("final") == 1
        final = exporter.heartbeats[-1]
        assert (final.final, final.step, final.dropped_records) == (True, 29, 0)
        assert exporter.steps() == list(range(1, 30))


def test_final_record_follows_every_record_at_close() -> None:
    with LoopbackExporter() as exporter:
        reporter = HttpReporter(exporter.url, **{**FAST, "flush_interval": 60.0})
        for step in range(1, 101):
            reporter.emit(make_record(step))
        reporter.close()  # nothing was sent yet: close flushes, then says goodbye
        assert exporter.steps() == list(range(1, 101))
        assert exporter.events[-1] == "final"
        assert [b.final for b in exporter.heartbeats] == [True]


def test_close_with_the_exporter_down_returns_within_about_a_second_by_default(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="ampscope")
    url = f"http://127.0.0.1:{free_port()}"
    reporter = HttpReporter(url, **FAST)
    for step in range(1, 11):
        reporter.emit(make_record(step))
    started = time.monotonic()
    reporter.close()  # retries for ever without its 1 s deadline: the guard would tell
    assert time.monotonic() - started < DEADLOCK_GUARD_S
    reporter._pipeline.thread.join(DEADLOCK_GUARD_S)
    assert (reporter.sent, reporter.dropped) == (0, 10)
    (message,) = [r.getMessage() for r in caplog.records if "cannot deliver" in r.getMessage()]
    assert f"cannot deliver to {url}" in message
    assert "`ampscope serve`" in message
    assert "AMPSCOPE_URL=off" in message


def _restart_forgetting(exporter: LoopbackExporter) -> None:
    """Kill the exporter and start it again on the same port, holding no rank."""
    exporter.stop()
    exporter.forget()
    exporter.start()


def test_an_idle_rank_sends_its_newest_record_again_to_a_restarted_exporter() -> None:
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.1
        reporter = HttpReporter(exporter.url, **FAST)
        try:
            for step in range(1, 8):
                reporter.emit(make_record(step))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            assert exporter.wait_until(lambda: "beat" in exporter.events, timeout=DEADLOCK_GUARD_S)
            _restart_forgetting(exporter)
            before = len(exporter.events)
            # The first beat is not applied; the newest record (cumulative totals) follows
            # once, and the beats after it are applied again.
            assert exporter.wait_until(lambda: exporter.events[before:].count("beat") >= 3)
            after = exporter.events[before:]
            assert after[:3] == ["beat?", "records", "beat"], after
            assert (after.count("records"), after.count("beat?")) == (1, 1), after
            (resent,) = exporter.accepted()[-1].records
            assert resent == make_record(7)  # its totals say 7 steps, 1 skipped
            assert (resent.totals.steps, resent.totals.skipped_steps) == (7, 1)
            assert (reporter.sent, reporter.dropped) == (7, 0)  # a resend is no new record
        finally:
            reporter.close()
        assert exporter.events[-1] == "final"


def test_a_rank_closing_after_an_exporter_restart_still_ends_finished() -> None:
    with LoopbackExporter() as exporter:
        reporter = HttpReporter(exporter.url, **FAST)  # beats every 10 s: none before close
        for step in range(1, 5):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        _restart_forgetting(exporter)
        reporter.close()
        assert exporter.events[-3:] == ["final?", "records", "final"], exporter.events
        assert exporter.accepted()[-1].records == [make_record(4)]
        assert [(b.final, b.step) for b in exporter.heartbeats] == [(True, 4), (True, 4)]


def test_an_exporter_refusing_the_resent_record_gets_one_per_heartbeat_at_most() -> None:
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.05
        reporter = HttpReporter(exporter.url, **FAST)
        try:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            exporter.forget()
            exporter.fail_next(503, times=1_000_000)  # every resend fails
            assert exporter.wait_until(lambda: exporter.events.count("beat?") >= 5)
            beats = exporter.events.count("beat?")
            resends = len(exporter.received) - 1
        finally:
            reporter.close()
        # No retry loop, no backoff pile-up: one resend per unapplied beat.
        assert beats >= 5
        assert resends in (beats, beats - 1, beats + 1)
