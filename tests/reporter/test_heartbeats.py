"""Heartbeats while a rank sends no records, the final record on close, and what a rank
says when it cannot deliver: HttpReporter against the loopback exporter."""

from __future__ import annotations

import logging
import time

from loopback_server import LoopbackExporter, make_record
from support import free_port

from ampscope.reporter.http import HttpReporter

FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0, "flush_interval": 0.05}


def test_idle_rank_beats_as_often_as_the_exporter_asks_then_says_goodbye() -> None:
    with LoopbackExporter() as exporter:
        exporter.heartbeat_interval_s = 0.1  # a quarter of a 0.4 s --stale-after
        reporter = HttpReporter(exporter.url, heartbeat_interval=30.0, **FAST)
        try:
            assert not exporter.wait_until(
                lambda: exporter.heartbeats, timeout=0.3
            )  # no record yet
            reporter.emit(make_record(1))
            reporter.emit(make_record(2))
            assert reporter.flush(timeout=3)
            # Idle from here on: heartbeats at least every 0.1 s (not the configured 30 s).
            started = time.monotonic()
            assert exporter.wait_until(lambda: len(exporter.heartbeats) >= 5, timeout=3)
            assert time.monotonic() - started < 1.5
            assert not any(beat.final for beat in exporter.heartbeats)
            beat = exporter.heartbeats[-1]
            assert (beat.identity.run, beat.identity.rank, beat.step) == ("run-a", 0, 2)
            # Records flowing again replace heartbeats.
            before = len(exporter.heartbeats)
            for step in range(3, 30):
                reporter.emit(make_record(step))
                time.sleep(0.01)
            assert len(exporter.heartbeats) - before <= 1
        finally:
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
    time.sleep(0.2)
    started = time.monotonic()
    reporter.close()
    elapsed = time.monotonic() - started
    assert elapsed < 1.5, f"close() took {elapsed:.2f}s"
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
            assert reporter.flush(timeout=3)
            assert exporter.wait_until(lambda: "beat" in exporter.events, timeout=3)
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
        assert reporter.flush(timeout=3)
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
            assert reporter.flush(timeout=3)
            exporter.forget()
            exporter.fail_next(503, times=1_000_000)  # every resend fails
            time.sleep(1.0)
            beats = len([e for e in exporter.events if e == "beat?"])
            resends = len(exporter.received) - 1
        finally:
            reporter.close()
        # No retry loop, no backoff pile-up: one resend per unapplied beat.
        assert beats >= 5
        assert resends in (beats, beats - 1, beats + 1)
