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
