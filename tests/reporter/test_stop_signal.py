"""A rank that its launcher stops with SIGTERM says so: the reporter's SIGTERM handler.

Real processes (``stopped_rank.py``) against the loopback exporter, which validates every
heartbeat with the real schema: what each SIGTERM disposition found becomes, how the
process ends (its exit status), and what reaches the exporter. In-process for what goes on
the wire to an exporter that predates ``stop_signal``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from loopback_server import LoopbackExporter, make_record
from support import DEADLOCK_GUARD_S

from ampscope.reporter import http
from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import Heartbeat

SCRIPT = Path(__file__).parent / "stopped_rank.py"
FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0, "flush_interval": 0.05}


@contextmanager
def _rank(
    exporter: LoopbackExporter, mode: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """The rank's process, once it printed ``ready``, and the lines it printed until then."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    variables.update(env or {})
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), exporter.url, mode],
        env=variables,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line.strip())
            if lines[-1] == "ready":
                break
        else:
            pytest.fail(f"the rank exited before it was ready: {process.communicate()}")
        yield process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=DEADLOCK_GUARD_S)


def _ends(process: subprocess.Popen[str]) -> tuple[int, str]:
    """(exit status, the rest of its output) once the process ended (a deadlock guard)."""
    out, err = process.communicate(timeout=DEADLOCK_GUARD_S)
    return process.returncode, out + err


def _finals(exporter: LoopbackExporter) -> list[tuple[int, int | None]]:
    """(rank, stop_signal) of every final heartbeat, in arrival order."""
    return [(b.identity.rank, b.stop_signal) for b in exporter.heartbeats if b.final]


def test_sigterm_says_stopped_then_ends_the_process_by_the_signal() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "default") as (process, lines):
        assert "handler ours" in lines
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        # What the launcher expects of a worker it stopped: killed by SIGTERM.
        assert code == -signal.SIGTERM, output
        assert _finals(exporter) == [(0, signal.SIGTERM)]


def test_sigkill_leaves_no_goodbye() -> None:
    # The fault lost_rank exists for: a process killed without a chance to speak.
    with LoopbackExporter() as exporter, _rank(exporter, "default") as (process, _):
        process.kill()
        code, _ = _ends(process)
        assert code == -signal.SIGKILL
        assert _finals(exporter) == []


def test_a_python_handler_installed_before_runs_after_the_goodbye() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "chained") as (process, lines):
        assert "handler ours" in lines
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        # The previous handler ran, after the final heartbeat went, and decided the exit.
        assert "previous handler ran after 1 final" in output
        assert code == 3, output
        assert _finals(exporter) == [(0, signal.SIGTERM)]


def test_a_library_handler_installed_after_ours_is_kept_and_chains_ours() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "library_after") as (process, lines):
        # The second reporter did not wrap the library's handler in ours again.
        assert "handler a Python function" in lines
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        assert "library handler ran" in output
        # A plain wrapper relies on the handler it called to end the process, as SIGTERM's
        # default would have (Lightning's integration says otherwise: see the next test).
        assert code == -signal.SIGTERM, output
        assert sorted(_finals(exporter)) == [(0, signal.SIGTERM), (1, signal.SIGTERM)]


def test_a_framework_that_ends_the_process_itself_is_left_to_end_it() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "framework_after") as (process, _):
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        assert "library handler ran" in output
        # The framework owns the end now: ours said goodbye and left it (Lightning
        # checkpoints on the exception it raises at the batch's end, then tears down).
        assert "graceful end after 2 final" in output
        assert code == 4, output
        assert sorted(_finals(exporter)) == [(0, signal.SIGTERM), (1, signal.SIGTERM)]


def test_an_ignored_sigterm_stays_ignored() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "ignored") as (process, lines):
        assert "handler SIG_IGN" in lines
        process.send_signal(signal.SIGTERM)
        # Checks that something does not happen: a slower machine only makes it pass.
        time.sleep(0.5)
        assert process.poll() is None
        assert _finals(exporter) == []


def test_turned_off_by_the_environment_no_handler_is_installed() -> None:
    env = {"AMPSCOPE_SIGTERM_HANDLER": "off"}
    with LoopbackExporter() as exporter, _rank(exporter, "default", env) as (process, lines):
        assert "handler SIG_DFL" in lines
        process.send_signal(signal.SIGTERM)
        code, _ = _ends(process)
        assert code == -signal.SIGTERM
        assert _finals(exporter) == []  # as before the handler: the rank reads lost


def test_every_reporter_of_the_process_says_goodbye_through_one_handler() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "two") as (process, lines):
        assert "handler ours" in lines
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        assert code == -signal.SIGTERM, output
        assert sorted(_finals(exporter)) == [(0, signal.SIGTERM), (1, signal.SIGTERM)]


def test_a_rank_that_closed_stays_finished_and_sigterm_still_ends_it() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "closed") as (process, _):
        assert _finals(exporter) == [(0, None)]
        process.send_signal(signal.SIGTERM)
        code, output = _ends(process)
        assert code == -signal.SIGTERM, output
        assert _finals(exporter) == [(0, None)]  # said finished; nothing more to say


def test_a_reporter_built_off_the_main_thread_installs_nothing() -> None:
    with LoopbackExporter() as exporter, _rank(exporter, "thread") as (process, lines):
        assert "handler SIG_DFL" in lines  # signal.signal works on the main thread only
        process.send_signal(signal.SIGTERM)
        code, _ = _ends(process)
        assert code == -signal.SIGTERM


def test_a_plain_final_heartbeat_carries_no_stop_signal_key() -> None:
    """An exporter that predates ``stop_signal`` refuses unknown fields: a rank that ends by
    itself sends exactly what it sent before the field existed."""
    with LoopbackExporter() as exporter:
        exporter.unknown_heartbeat_fields = {"stop_signal"}
        with HttpReporter(exporter.url, sigterm_handler=False, **FAST) as reporter:
            reporter.emit(make_record(1))
            assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        (body,) = exporter.heartbeat_bodies
        assert "stop_signal" not in json.loads(body)
        assert _finals(exporter) == [(0, None)]


def test_an_older_exporter_is_told_the_rank_ended_without_the_signal() -> None:
    with LoopbackExporter() as exporter:
        exporter.unknown_heartbeat_fields = {"stop_signal"}
        reporter = HttpReporter(exporter.url, sigterm_handler=False, **FAST)
        reporter.emit(make_record(1))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        reporter._pipeline.note_stop(signal.SIGTERM)  # what the handler does first
        reporter.close(timeout=DEADLOCK_GUARD_S)
        refused, taken = (json.loads(body) for body in exporter.heartbeat_bodies)
        assert refused["stop_signal"] == signal.SIGTERM
        assert "stop_signal" not in taken
        # That exporter reads the rank finished: it said goodbye, so it is never lost.
        (beat,) = exporter.heartbeats
        assert beat == Heartbeat.model_validate(taken)
        assert beat.final


def test_sigterm_during_a_normal_close_leaves_the_rank_finished() -> None:
    # Training ended and the reporter is closing (its records still going: the exporter
    # refuses them for now) when SIGTERM comes (a time limit during the last flush): the
    # goodbye waits for that close, and the rank ends finished, not stopped.
    with LoopbackExporter() as exporter:
        reporter = HttpReporter(exporter.url, sigterm_handler=False, **FAST)
        reporter.emit(make_record(1))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        exporter.fail_next(503, times=1_000_000)
        reporter.emit(make_record(2))
        closing = threading.Thread(target=reporter.close, kwargs={"timeout": DEADLOCK_GUARD_S})
        closing.start()
        assert exporter.wait_until(lambda: reporter._closed and reporter.pending > 0)
        # The handler's goodbye, as the signal would run it: done before anything else
        # moves (it returns by the reporter's exit_timeout, the records still refused).
        http._stop_all(signal.SIGTERM)
        with exporter._lock:
            exporter._failures.clear()
        closing.join(DEADLOCK_GUARD_S)
        assert not closing.is_alive()
        assert _finals(exporter) == [(0, None)]
