"""The one HTTP client (``ampscope.status.transport``) as both commands use it, attacked:
``ampscope devices`` sends its token to Prometheus' origin only, never to the origin a
redirect names; a Prometheus answer holding ``NaN`` or ``1e400`` where a count belongs is
a malformed answer (exit 7) for ``status --prometheus`` and ``devices`` alike, never an
internal error (70); a reader that closes the pipe early ends either command quietly.

Loopback servers (``fake_api``) record the headers they receive; the commands run as a user
runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_api import Reply, serving
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port

from ampscope.status.pipe import EXIT_CLOSED_PIPE
from ampscope.status.transport import EXIT_MALFORMED

EMPTY_VECTOR = Reply({"status": "success", "data": {"resultType": "vector", "result": []}})


def _vector(*samples: tuple[dict[str, str], str]) -> Reply:
    result = [{"metric": labels, "value": [1.7e9, value]} for labels, value in samples]
    return Reply({"status": "success", "data": {"resultType": "vector", "result": result}})


def _devices(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "devices", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=DEADLOCK_GUARD_S * 2,
        check=False,
    )


def test_devices_sends_no_token_to_another_origin(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    with serving({"/api/v1/query": EMPTY_VECTOR}) as elsewhere, serving() as prometheus:
        # Another port on the same host is another origin.
        prometheus.routes["/api/v1/query"] = Reply(
            status=307, location=f"{elsewhere.url}/api/v1/query"
        )
        done = _devices("--prometheus", prometheus.url, "--bearer-token-file", str(token))
    assert done.returncode == 0, done.stderr
    assert "no device offended." in done.stdout
    assert prometheus.authorizations() == ["Bearer t0ken"] * 3
    # The three queries followed the redirect (a 307 keeps the POST), without the token.
    assert [r.method for r in elsewhere.received] == ["POST"] * 3
    assert elsewhere.authorizations() == [None] * 3


def test_devices_keeps_the_token_within_the_origin(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    routes = {
        "/api/v1/query": Reply(status=308, location="/prometheus/api/v1/query"),
        "/prometheus/api/v1/query": EMPTY_VECTOR,
    }
    with serving(routes) as prometheus:
        done = _devices("--prometheus", prometheus.url, "--bearer-token-file", str(token))
    assert done.returncode == 0, done.stderr
    assert prometheus.authorizations() == ["Bearer t0ken"] * 6


RANK = {"run": "r1", "rank": "0", "node": "n1", "local_rank": "0", "world_size": "1"}


@pytest.mark.parametrize("value", ["NaN", "1e400", "-Inf"])
def test_a_non_finite_count_is_malformed_not_an_internal_error(value: str) -> None:
    """Both commands, one answer each: a step counter that is not a finite number."""
    steps = _vector(({"__name__": "ampscope_last_step", **RANK}, value))
    with serving({"/api/v1/query": steps}) as prometheus:
        status = run_status("--prometheus", prometheus.url, "r1")
    assert status.returncode == EXIT_MALFORMED, status.stderr
    assert "internal error" not in status.stderr
    assert f"ampscope_last_step is '{value}', not a finite number" in status.stderr
    offences = _vector(({"run": "r1", "device": "GPU-a", "node": "n1", "kind": "k"}, value))
    with serving({"/api/v1/query": offences}) as prometheus:
        devices = _devices("--prometheus", prometheus.url)
    assert devices.returncode == EXIT_MALFORMED, devices.stderr
    assert "not a finite number" in devices.stderr
    assert "Traceback" not in status.stderr + devices.stderr


def test_json_without_nan_or_infinity() -> None:
    """Python's json reads the bare words NaN and Infinity; JSON has neither."""
    raw = b'{"status":"success","data":{"resultType":"vector","result":[],"x":NaN}}'
    with serving({"/api/v1/query": Reply(raw=raw)}) as prometheus:
        done = run_status("--prometheus", prometheus.url)
    assert done.returncode == EXIT_MALFORMED, done.stderr
    assert "not JSON" in done.stderr


def _closed_pipe_run(argv: list[str]) -> tuple[int, str]:
    """``argv`` with its standard output a pipe nobody reads any more: the read end is
    closed before the command starts, so its first write fails, whatever the timing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            argv,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=DEADLOCK_GUARD_S * 2,
            check=False,
        )
    finally:
        os.close(write_end)
    return done.returncode, done.stderr


def test_a_closed_pipe_ends_both_commands_quietly() -> None:
    summary = {"ranks": 1, "up": 1, "stale": 0, "states": {"running": 1}, "world_size": 1}
    runs = [
        {"run": f"run-{i}", **summary, "newest_step": 1, "last_report_time": 1.7e9}
        for i in range(3)
    ]
    health = {"status": "ok", "evaluated_at": 1.7e9, "ranks": 1, "up": 1, "verdicts": []}
    routes = {"/api/v1/runs": Reply(runs)}
    for i in range(3):
        routes[f"/api/v1/runs/run-{i}/ranks"] = Reply([])
        routes[f"/api/v1/runs/run-{i}/health"] = Reply({**health, "run": f"run-{i}"})
    with serving(routes) as exporter:
        code, stderr = _closed_pipe_run(
            [sys.executable, "-m", "ampscope.cli", "status", "--url", exporter.url]
        )
        assert (code, stderr) == (EXIT_CLOSED_PIPE, "")
        code, stderr = _closed_pipe_run(
            [sys.executable, "-m", "ampscope.cli", "status", "--url", exporter.url, "--json"]
        )
        assert (code, stderr) == (EXIT_CLOSED_PIPE, "")
    # One answer for all three queries: the labels of each (DCGM's field included).
    labels = {"run": "r1", "device": "GPU-a", "node": "n1", "kind": "k", "field": "f",
              "UUID": "GPU-a"}  # fmt: skip
    offences = _vector((labels, "1"))
    with serving({"/api/v1/query": offences}) as prometheus:
        code, stderr = _closed_pipe_run(
            [sys.executable, "-m", "ampscope.cli", "devices", "--prometheus", prometheus.url]
        )
    assert (code, stderr) == (EXIT_CLOSED_PIPE, "")


def test_devices_warns_of_credentials_in_clear_text(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    far = f"http://ampscope-test.invalid:{free_port()}"  # never resolves: nothing is sent
    done = _devices("--prometheus", far, "--bearer-token-file", str(token))
    assert done.returncode == 3
    assert done.stderr.splitlines()[0] == (
        f"ampscope devices: warning: the Prometheus credentials sent to {far} over plain "
        "http://, readable by anyone on the network path; use https:// (tls_server_config in "
        "the server's web config)"
    )
    assert "warning" not in _devices("--prometheus", far).stderr  # no credentials
