"""HttpReporter against a real HTTP server on loopback (tests/reporter/loopback_server.py)."""

from __future__ import annotations

import gc
import logging
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from loopback_server import LoopbackExporter, make_record
from support import DEADLOCK_GUARD_S, free_port

from ampscope.reporter.http import HttpReporter
from ampscope.reporter.pipeline import HttpReporterConfig, retry_delay
from ampscope.reporter.schema import DEFAULT_URL
from ampscope.reporter.transport import url_from_env

FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0}


@pytest.fixture
def exporter():
    with LoopbackExporter() as server:
        yield server


def reporter_for(server: LoopbackExporter, **kwargs) -> HttpReporter:
    return HttpReporter(server.url, **{"flush_interval": 10.0, **FAST, **kwargs})


def test_full_batches_go_at_once_the_rest_on_flush_all_over_one_connection(exporter):
    reporter = reporter_for(exporter, max_batch=10)
    try:
        for step in range(1, 26):
            reporter.emit(make_record(step))
        # Two full batches leave without waiting for the 10 s flush interval.
        assert exporter.wait_until(lambda: len(exporter.steps()) == 20)
        # Not proof against a sender that sends partial batches early, but a chance to
        # catch one: a slower machine can only make this pass.
        time.sleep(0.1)
        assert len(exporter.steps()) == 20, "a partial batch left before the flush interval"
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        assert [len(b.records) for b in exporter.accepted()] == [10, 10, 5]
        assert exporter.steps() == list(range(1, 26))
        assert {r.connection for r in exporter.received} == {1}, "keep-alive not reused"
        assert all(r.error == "" for r in exporter.received)
        assert [b.dropped_records for b in exporter.accepted()] == [0, 0, 0]
        assert (reporter.sent, reporter.dropped, reporter.pending) == (25, 0, 0)
    finally:
        reporter.close(1)


def test_flush_interval_sends_a_partial_batch(exporter):
    reporter = reporter_for(exporter, flush_interval=0.05)
    try:
        for step in (1, 2, 3):
            reporter.emit(make_record(step))
        assert exporter.wait_until(lambda: exporter.steps() == [1, 2, 3])
    finally:
        reporter.close(1)


def test_bearer_token_from_argument_or_environment(exporter, monkeypatch):
    monkeypatch.delenv("AMPSCOPE_TOKEN", raising=False)
    plain = reporter_for(exporter)
    plain.emit(make_record(1))
    plain.close(DEADLOCK_GUARD_S)
    monkeypatch.setenv("AMPSCOPE_TOKEN", "from-env")
    from_env = reporter_for(exporter)
    from_env.emit(make_record(2))
    from_env.close(DEADLOCK_GUARD_S)
    explicit = reporter_for(exporter, token="s3cret")
    explicit.emit(make_record(3))
    explicit.close(DEADLOCK_GUARD_S)
    auth = [r.headers.get("Authorization") for r in exporter.received]
    assert auth == [None, "Bearer from-env", "Bearer s3cret"]
    assert exporter.steps() == [1, 2, 3]


def test_5xx_and_429_are_retried_and_logged_once(exporter, caplog):
    caplog.set_level(logging.INFO, logger="ampscope")
    exporter.fail_next(503, times=3)
    exporter.fail_next(429, headers={"Retry-After": "0"})
    reporter = reporter_for(exporter)
    try:
        for step in range(1, 6):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        assert [r.status for r in exporter.received] == [503, 503, 503, 429, 200]
        assert exporter.steps() == [1, 2, 3, 4, 5]
        assert (reporter.sent, reporter.dropped) == (5, 0)
    finally:
        reporter.close(1)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot deliver" in m for m in messages) == 1, messages
    assert sum("again after 4 failed attempts" in m for m in messages) == 1, messages


def test_backs_off_while_down_and_delivers_when_back_on_the_same_port():
    server = LoopbackExporter().start()
    reporter = HttpReporter(server.url, flush_interval=0.05, **FAST)
    try:
        reporter.emit(make_record(1))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        server.stop()  # also cuts the kept-alive connection
        for step in range(2, 22):
            reporter.emit(make_record(step))
        # Retried with backoff (its delays: test_retry_delays_double_up_to_the_cap...).
        assert server.wait_until(lambda: reporter._pipeline.failures >= 3)
        assert reporter.pending == 20
        assert not reporter.flush(timeout=0.1)
        server.start()
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        assert server.steps() == list(range(1, 22))
        assert (reporter.sent, reporter.dropped) == (21, 0)
        assert reporter._pipeline.failures == 0, "recovery did not reset the backoff"
    finally:
        reporter.close(1)
        server.stop()


def test_a_closed_keepalive_connection_is_replaced_without_a_failure(caplog):
    caplog.set_level(logging.INFO, logger="ampscope")
    server = LoopbackExporter().start()
    reporter = HttpReporter(server.url, **FAST)
    try:
        reporter.emit(make_record(1))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        server.stop()
        server.start()  # the reporter still holds the connection the old server cut
        reporter.emit(make_record(2))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        assert server.steps() == [1, 2]
        assert [r.connection for r in server.received] == [1, 2]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        reporter.close(1)
        server.stop()


def test_full_queue_drops_oldest_and_the_newest_totals_arrive():
    port = free_port()  # nothing listens yet: the exporter is down
    reporter = HttpReporter(
        f"http://127.0.0.1:{port}", max_queue=5, max_batch=2, flush_interval=10.0, **FAST
    )
    try:
        for step in range(1, 51):
            reporter.emit(make_record(step))
        assert reporter.pending <= 5 + 2
        with LoopbackExporter(port) as server:
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
            delivered = server.steps()
            batches = server.accepted()
        # In flight when the queue overflowed: at most one batch of the oldest records.
        # Waiting: always the newest max_queue records.
        assert delivered[-5:] == [46, 47, 48, 49, 50]
        assert len(delivered) <= 7
        assert delivered == sorted(delivered)
        assert reporter.dropped == 50 - len(delivered)
        assert batches[-1].records[-1].totals.steps == 50
        assert batches[-1].dropped_records == reporter.dropped
    finally:
        reporter.close(1)


def test_4xx_is_not_retried_dropped_counted_and_logged_once_per_status(exporter, caplog):
    caplog.set_level(logging.INFO, logger="ampscope")
    reporter = reporter_for(exporter)
    try:
        exporter.fail_next(422, detail=[{"msg": "schema_version mismatch"}])
        for step in (1, 2, 3):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        exporter.fail_next(401, times=2, detail="bad token")
        reporter.emit(make_record(4))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        reporter.emit(make_record(5))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        reporter.emit(make_record(6))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        assert [r.status for r in exporter.received] == [422, 401, 401, 200]
        assert (reporter.sent, reporter.dropped) == (1, 5)
        assert exporter.accepted()[-1].dropped_records == 5
    finally:
        reporter.close(1)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors
    assert "HTTP 422" in errors[0]
    assert "schema_version mismatch" in errors[0]
    assert "HTTP 401" in errors[1]
    assert "bad token" in errors[1]
    assert not [r for r in caplog.records if "cannot deliver" in r.getMessage()]


def test_413_halves_the_batch(exporter):
    reporter = reporter_for(exporter, max_batch=8)
    try:
        exporter.fail_next(413, detail="body too large")
        for step in range(1, 9):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        sizes = [(r.status, len(r.batch.records)) for r in exporter.received]
        assert sizes == [(413, 8), (200, 4), (200, 4)]
        assert exporter.steps() == list(range(1, 9))
    finally:
        reporter.close(1)


def test_close_with_exporter_down_returns_within_its_timeout():
    refused = HttpReporter(f"http://127.0.0.1:{free_port()}", **FAST)
    # A listener that takes the request and never answers it.
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        hung = HttpReporter(
            f"http://127.0.0.1:{blackhole.getsockname()[1]}", flush_interval=0.01, timeout=600.0
        )
        for step in range(1, 11):
            refused.emit(make_record(step))
            hung.emit(make_record(step))
        blackhole.settimeout(DEADLOCK_GUARD_S)
        conn, _ = blackhole.accept()
        with conn:
            conn.settimeout(DEADLOCK_GUARD_S)
            assert conn.recv(4096).startswith(b"POST ")
            # hung's thread is now blocked reading a reply that never comes: only close's
            # own deadline (0.5 s), far inside the socket's 600 s, can end it.
            for reporter in (refused, hung):
                start = time.monotonic()
                reporter.close(0.5)
                assert time.monotonic() - start < DEADLOCK_GUARD_S
                reporter._pipeline.thread.join(DEADLOCK_GUARD_S)
                assert not reporter._pipeline.thread.is_alive()
                assert (reporter.sent, reporter.dropped, reporter.pending) == (0, 10, 0)
    refused.close(1)  # idempotent


def test_emit_never_raises_and_bad_records_are_dropped(exporter, caplog):
    reporter = reporter_for(exporter)
    reporter.emit(make_record(1))
    reporter.emit(None)  # type: ignore[arg-type]
    reporter.emit(object())  # type: ignore[arg-type]
    reporter.emit(make_record(2))
    assert reporter.flush(timeout=DEADLOCK_GUARD_S)
    assert exporter.steps() == [1, 2]
    assert (reporter.sent, reporter.dropped) == (2, 2)
    reporter.close(1)
    reporter.emit(make_record(3))  # after close: dropped, not raised
    assert reporter.dropped == 3
    assert sum("cannot encode" in r.getMessage() for r in caplog.records) == 1


def test_garbage_collected_reporter_stops_its_thread(exporter):
    reporter = reporter_for(exporter, flush_interval=0.05)
    reporter.emit(make_record(1))
    thread = reporter._pipeline.thread
    del reporter
    gc.collect()
    thread.join(DEADLOCK_GUARD_S)
    assert not thread.is_alive()
    assert exporter.steps() == [1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch": 0}, "max_batch must be a positive integer"),
        ({"max_batch": 4096}, "max_batch must be <= 2048"),
        ({"max_queue": 1.5}, "max_queue must be a positive integer"),
        ({"flush_interval": 0}, "flush_interval must be a positive number"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"retry_initial": 2.0, "retry_max": 1.0}, "retry_max"),
        ({"url": "ftp://host:1"}, "must look like http://host:port"),
        ({"url": "http://host:99999"}, "invalid port"),
    ],
)
def test_invalid_settings_are_rejected_with_a_clear_error(kwargs, message):
    kwargs = {"url": "http://127.0.0.1:1", **kwargs}
    with pytest.raises(ValueError, match=message):
        HttpReporter(**kwargs)


def test_url_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("AMPSCOPE_URL", raising=False)
    assert url_from_env() == DEFAULT_URL
    monkeypatch.setenv("AMPSCOPE_URL", "http://exporter:1234/")
    assert url_from_env() == "http://exporter:1234/"
    reporter = HttpReporter(**FAST)
    assert reporter.url == "http://exporter:1234"
    reporter.close(0)
    monkeypatch.setenv("AMPSCOPE_URL", "off")
    assert url_from_env() is None
    with pytest.raises(ValueError, match="reporting disabled"):
        HttpReporter()


def test_a_token_over_plain_http_to_another_machine_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="ampscope")
    far = "http://ampscope-test.invalid:9478"
    for url, token in ((far, "s3cret"), ("http://127.0.0.1:9", "s3cret"), (far, None)):
        HttpReporter(url, token=token, **FAST).close(0)
    warnings = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
    assert warnings == [
        f"ampscope reporter: warning: the bearer token sent to {far} over plain http://, "
        "readable by anyone on the network path; use https:// (tls_server_config in the "
        "server's web config)"
    ]


_EXIT_SCRIPT = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from loopback_server import make_record
from ampscope.reporter.http import HttpReporter
reporter = HttpReporter({url!r}, flush_interval=60.0, exit_timeout=1.0)
for step in range(1, 6):
    reporter.emit(make_record(step))
"""


def _exit_without_close(url: str) -> str:
    """Run a script that leaves a reporter open at exit; its stderr. A hang at exit (the
    retries to a dead exporter go on for ever without exit_timeout) fails the test after
    DEADLOCK_GUARD_S."""
    here = Path(__file__).parent
    script = textwrap.dedent(_EXIT_SCRIPT).format(here=str(here), tests=str(here.parent), url=url)
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, timeout=DEADLOCK_GUARD_S, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stderr.decode()


def test_interpreter_exit_flushes_and_does_not_hang_on_a_dead_exporter(exporter):
    _exit_without_close(exporter.url)
    assert exporter.steps() == [1, 2, 3, 4, 5]
    # Nothing listening: the exit flush gives up at exit_timeout, dropping the records.
    stderr = _exit_without_close(f"http://127.0.0.1:{free_port()}")
    assert "gave up on 5 records at close" in stderr, stderr


def test_retry_delays_double_up_to_the_cap_with_jitter_and_retry_after() -> None:
    """The backoff is a schedule, not a busy loop (checked without a clock)."""
    config = HttpReporterConfig(url="http://127.0.0.1:1", retry_initial=0.02, retry_max=0.1)
    no_jitter = [retry_delay(config, n, None, lambda low, high: high) for n in range(1, 7)]
    assert no_jitter == pytest.approx([0.02, 0.04, 0.08, 0.1, 0.1, 0.1])
    most_jitter = [retry_delay(config, n, None, lambda low, high: low) for n in range(1, 4)]
    assert most_jitter == pytest.approx([0.01, 0.02, 0.04])
    assert retry_delay(config, 1, 0.07, lambda low, high: high) == pytest.approx(0.07)
    assert retry_delay(config, 1, 60.0, lambda low, high: high) == pytest.approx(0.1)


def test_every_batch_repeats_the_device_the_first_record_named(exporter):
    from ampscope.reporter.schema import DeviceIdentity

    device = DeviceIdentity(
        device="GPU-10111213-1415-1617-1819-1a1b1c1d1e1f",
        pci_bus_id="00000000:3B:00.0",
        hostname="host-a",
    )
    reporter = reporter_for(exporter, max_batch=4)
    try:
        reporter.emit(make_record(1).model_copy(update={"device": device}))
        for step in range(2, 11):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        batches = exporter.accepted()
        assert [len(b.records) for b in batches] == [4, 4, 2]
        # The record itself names it once; the batches, so that an exporter that restarted
        # learns it again, each time.
        assert [r.device for b in batches for r in b.records] == [device] + [None] * 9
        assert [b.device for b in batches] == [device] * 3
    finally:
        reporter.close(1)
