"""Stop signals end `ampscope demo` and every process it started: SIGINT (Ctrl-C), SIGTERM
(kill, timeout, systemd, job schedulers) and SIGHUP (a closed terminal), while it trains and
while it keeps serving. Real processes; each wait is a deadlock guard, not a speed claim."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import DEADLOCK_GUARD_S, free_port

pytestmark = pytest.mark.distributed

STOP_SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ampscope.cli", "demo", "--scenario", "overflow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # Its own session, as a service or a batch job runs it: the signal goes to the
        # demo alone (a terminal's Ctrl-C would reach its whole process group).
        start_new_session=True,
    )


def _read_until(process: subprocess.Popen[str], marker: str) -> str:
    """The demo's output up to the first line holding ``marker`` (pytest's timeout guards)."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    pytest.fail(f"the demo exited before {marker!r}:\n" + "".join(lines))


def _children(pid: int) -> dict[int, int]:
    """{pid: parent pid} of every process on the machine."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> set[int]:
    """Every process started by ``pid``, directly or not (as /proc shows them now)."""
    parents = _children(pid)
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent or init reaps it


def assert_all_gone(pids: set[int], port: int) -> None:
    """Every process in ``pids`` exits and ``port`` can be listened on again."""
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while (left := {pid for pid in pids if _running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running: {left}"
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # raises while anything still listens there
        probe.listen()


@pytest.mark.parametrize("stop", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_while_training_ends_the_demo_and_every_child(stop: int) -> None:
    port = free_port()
    process = _demo(
        "--port", str(port), "--steps", "30", "--step-delay", "1", "--progress-every", "1"
    )
    try:
        _read_until(process, "step    1/30")  # exporter up, ranks training
        started = descendants(process.pid)
        # The exporter and the two ranks (multiprocessing may add its resource tracker).
        assert len(started) >= 3, started
        process.send_signal(stop)
        rest, _ = process.communicate(timeout=DEADLOCK_GUARD_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # only if the test failed
    assert process.returncode == 128 + stop, rest
    assert f"interrupted ({signal.Signals(stop).name})" in rest
    assert_all_gone(started, port)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_ends_keep_serving_as_ctrl_c_does(stop: int) -> None:
    """(SIGINT: test_demo_cli.test_demo_trains_into_every_expected_verdict_and_keeps_serving.)"""
    port = free_port()
    process = _demo("--port", str(port), "--steps", "30", "--keep-serving")
    try:
        output = _read_until(process, "Ctrl-C stops it")
        started = descendants(process.pid)
        assert started, "the exporter the demo serves with"
        process.send_signal(stop)
        process.communicate(timeout=DEADLOCK_GUARD_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    # After the verdict, a stop signal is how serving ends: the verdict's status.
    verdict = 0 if "Every scenario drew the verdicts it was built to provoke." in output else 1
    assert process.returncode == verdict, output
    assert_all_gone(started, port)
