"""The exporter under attack, for real: `ampscope serve` on a loopback port against
slowloris clients, stalled uploads, a connection flood and a killed rank."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import DEADLOCK_GUARD_S, free_port

from ampscope.exporter.api.routes.heartbeat import MAX_HEARTBEAT_BYTES
from ampscope.exporter.http.parse import MAX_JSON_DEPTH
from ampscope.reporter.schema import HEARTBEAT_PATH, INGEST_PATH
from exporter.api.routes.test_body_depth import deep

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
SLOWLORIS = 300
STALLED = 100
STALLED_DECLARED = 64 * 1024
INFLIGHT = 2 * 1024 * 1024
"""Room for 32 stalled 64 KiB uploads: the others are turned away with 429 at once."""
MAX_CONNECTIONS = 600


class Server:
    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.port = port
        self.proc = proc
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rejections(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=DEADLOCK_GUARD_S).text
        (family,) = [
            f
            for f in text_string_to_metric_families(text)
            if f.name == "ampscope_exporter_ingest_rejections"
        ]
        return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


@contextlib.contextmanager
def serve(tmp_path: Path, *args: str) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(port, proc, log)
    try:
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ampscope serve did not come up:\n{log.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(
        tmp_path_factory.mktemp("attack"),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--max-inflight-bytes",
        str(INFLIGHT),
    ) as srv:
        yield srv


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLOCK_GUARD_S)
    sock.settimeout(DEADLOCK_GUARD_S)
    return sock


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes, or what came within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _status(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def _error_body(answer: bytes) -> dict[str, object]:
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    body = json.loads(payload)
    assert set(body) >= {"error", "detail"}, body
    return body


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Attack:
    """Keeps ``SLOWLORIS`` connections dribbling header bytes and ``STALLED`` uploads
    stalled halfway, reopening whatever the server closes, until ``stop``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.slow: list[socket.socket] = []
        self.stalled: list[socket.socket] = []
        self.opened = {"slow": 0, "stalled": 0}
        self.cut = {"slow": 0, "stalled": 0}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _open_slow(self) -> socket.socket:
        sock = _connect(self.port)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        self.opened["slow"] += 1
        return sock

    def _open_stalled(self) -> socket.socket:
        sock = _connect(self.port)
        sock.sendall(
            b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{" % STALLED_DECLARED + b" " * (STALLED_DECLARED // 2)
        )
        self.opened["stalled"] += 1
        return sock

    def __enter__(self) -> Attack:
        self.slow = [self._open_slow() for _ in range(SLOWLORIS)]
        self.stalled = [self._open_stalled() for _ in range(STALLED)]
        self._thread.start()
        return self

    def _alive(self, sock: socket.socket) -> bool:
        sock.setblocking(False)
        try:
            # Anything, an answer or the end, means the server is done with it.
            sock.recv(1, socket.MSG_PEEK)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            sock.setblocking(True)

    def _run(self) -> None:
        try:
            self._dribble()
        except Exception as exc:  # reported by the test, not lost with the thread
            self.errors.append(repr(exc))

    def _dribble(self) -> None:
        while not self._stop.wait(0.25):
            for i, sock in enumerate(self.slow):
                try:
                    if not self._alive(sock):
                        raise OSError
                    sock.sendall(b"X-Dribble: 1\r\n")
                except OSError:
                    sock.close()
                    self.cut["slow"] += 1
                    self.slow[i] = self._open_slow()
            for i, sock in enumerate(self.stalled):
                if not self._alive(sock):
                    sock.close()
                    self.cut["stalled"] += 1
                    self.stalled[i] = self._open_stalled()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for sock in self.slow + self.stalled:
            sock.close()


ATTACK_GUARD_S = 180.0
"""Deadlock guard of the attack: it runs until every attacking connection was cut once."""


def test_slowloris_and_stalled_uploads_cannot_hold_the_exporter(server: Server) -> None:
    before = server.rejections()
    rss_before, fds_before = server.rss_mib(), server.open_fds()
    latencies: dict[str, list[float]] = {"/healthz": [], "/metrics": []}
    rss_peak = rss_before
    with (
        Attack(server.port) as attack,
        httpx.Client(base_url=server.url, timeout=DEADLOCK_GUARD_S) as http,
    ):
        assert server.open_fds() >= fds_before + SLOWLORIS  # the attack is really in place
        # Probed until the timeouts cut every attacking connection once, however long a
        # loaded machine takes; every probe must be answered meanwhile.
        deadline = time.monotonic() + ATTACK_GUARD_S
        while attack.cut["slow"] < SLOWLORIS or attack.cut["stalled"] < STALLED:
            assert time.monotonic() < deadline, f"connections cut so far: {attack.cut}"
            for path, samples in latencies.items():
                started = time.perf_counter()
                assert http.get(path).status_code == 200
                samples.append(time.perf_counter() - started)
            rss_peak = max(rss_peak, server.rss_mib())
            time.sleep(0.01)  # probe pacing
        attack.stop()
        # Stop dribbling: every connection still open gets its 408 from the timeouts.
        answers = [_answer(s, DEADLOCK_GUARD_S) for s in attack.slow]
        stalled_answers = [_answer(s, DEADLOCK_GUARD_S) for s in attack.stalled]
    # For the reader only: latency is not a verdict here (it depends on the machine).
    p99 = {path: _p99(samples) * 1e3 for path, samples in latencies.items()}
    print(
        f"\nattack: {attack.opened} opened, {attack.cut} cut while dribbling; "
        f"p99 ms {p99}, n={len(latencies['/healthz'])}; RSS {rss_before:.0f} -> "
        f"peak {rss_peak:.0f} MiB"
    )
    assert attack.errors == []
    # Connections were cut by the timeouts while the attack ran (reopened ones included).
    assert attack.cut["slow"] >= SLOWLORIS
    assert attack.cut["stalled"] >= STALLED
    assert {_status(a) for a in answers} == {408}
    assert _error_body(answers[0])["error"] == "header_timeout"
    assert {_status(a) for a in stalled_answers} <= {408, 429}
    assert 408 in {_status(a) for a in stalled_answers}
    assert rss_peak - rss_before < 150
    # All closed: the exporter's descriptors are back to where they were.
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while server.open_fds() > fds_before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.open_fds() <= fds_before + 5
    after = server.rejections()
    assert after["header_timeout"] - before["header_timeout"] >= SLOWLORIS
    assert after["body_timeout"] - before["body_timeout"] >= 1
    assert after["busy"] - before["busy"] >= 1  # uploads beyond max_inflight_bytes


def test_killed_rank_mid_body_costs_one_log_line_and_a_count(server: Server) -> None:
    before = server.rejections()["client_disconnect"]
    script = (
        "import socket, sys, time\n"
        f"s = socket.create_connection(('127.0.0.1', {server.port}))\n"
        "s.sendall(b'POST /api/v1/ingest HTTP/1.1\\r\\nHost: x\\r\\n'"
        " b'Content-Type: application/json\\r\\n'"
        " b'Content-Length: 100000\\r\\n\\r\\n{' + b' ' * 50000)\n"
        "print('sent', flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert rank.stdout is not None
    assert rank.stdout.readline() == b"sent\n"
    rank.send_signal(signal.SIGKILL)
    rank.wait(DEADLOCK_GUARD_S)
    deadline = time.monotonic() + DEADLOCK_GUARD_S
    while server.rejections()["client_disconnect"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.rejections()["client_disconnect"] == before + 1
    log = server.log.read_text()
    lines = [line for line in log.splitlines() if "disconnected after" in line]
    assert len(lines) == 1, log[-3000:]
    # How much of the body the server read before the end depends on scheduling.
    assert re.search(r"after \d+ of 100000 body bytes", lines[0]), lines[0]
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (INGEST_PATH, deep(50_000, "array")),
        (INGEST_PATH, deep(50_000, "object")),
        (HEARTBEAT_PATH, deep(MAX_HEARTBEAT_BYTES // 2, "array")),
    ],
    ids=["ingest-arrays", "ingest-objects", "heartbeat-arrays"],
)
def test_a_body_nested_too_deep_costs_a_400_and_at_most_a_log_line(
    server: Server, path: str, payload: bytes
) -> None:
    log_before = server.log.read_text().splitlines()
    before = server.rejections()["malformed"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post(path, content=payload)
        assert response.status_code == 400, response.text
        assert (response.json()["limit"], response.json()["value"]) == (
            "max_json_depth",
            MAX_JSON_DEPTH,
        )
        assert http.get("/metrics").status_code == 200
    assert server.rejections()["malformed"] == before + 1
    log = server.log.read_text()
    assert "Traceback" not in log
    assert len(log.splitlines()) - len(log_before) <= 1, log[-3000:]


def test_malformed_http_and_unknown_paths_answer_the_error_body(server: Server) -> None:
    sock = _connect(server.port)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    answer = _answer(sock, DEADLOCK_GUARD_S)
    sock.close()
    assert _status(answer) == 400
    assert _error_body(answer)["error"] == "malformed"
    with httpx.Client(base_url=server.url, timeout=DEADLOCK_GUARD_S) as http:
        response = http.get("/nope")
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"
        response = http.delete("/metrics")
        assert response.status_code == 405
        assert response.json()["error"] == "method_not_allowed"


def test_connection_cap_answers_503_then_recovers(tmp_path: Path) -> None:
    cap = 40
    # The idle connections must still be open when the last one comes: the header timeout
    # is a deadlock guard, not a race.
    header_timeout = "10"
    with serve(tmp_path, "--max-connections", str(cap), "--header-timeout", header_timeout) as srv:
        idle = [_connect(srv.port) for _ in range(cap)]
        # Accepted in the order they came: the server counts the idle ones first.
        sock = _connect(srv.port)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _answer(sock, DEADLOCK_GUARD_S)
        sock.close()
        assert _status(answer) == 503, answer
        assert b"retry-after: 1" in answer.lower()
        body = _error_body(answer)
        assert (body["error"], body["limit"], body["value"]) == (
            "over_capacity",
            "max_connections",
            cap,
        )
        # The idle connections are cut by the header timeout; then it serves again.
        assert all(_status(_answer(s, DEADLOCK_GUARD_S)) == 408 for s in idle)
        for s in idle:
            s.close()
        assert httpx.get(f"{srv.url}/healthz", timeout=DEADLOCK_GUARD_S).status_code == 200
        assert srv.rejections()["over_capacity"] == 1


def test_the_servers_own_refusals_carry_the_web_configs_headers(tmp_path: Path) -> None:
    """408 and 503 are written by the protocol, under the app and its middleware."""
    (tmp_path / "web.yml").write_text("http_server_config: {headers: {X-Frame-Options: deny}}\n")
    flags = ["--web-config-file", str(tmp_path / "web.yml"), "--header-timeout", "0.5"]
    with (
        serve(tmp_path, *flags, "--max-connections", "1") as srv,
        socket.create_connection(("127.0.0.1", srv.port)) as first,
    ):
        first.sendall(b"GET /healthz HTTP/1.1\r\n")  # never finishes its headers
        with socket.create_connection(("127.0.0.1", srv.port)) as second:
            over = _answer(second, 10)
        timed_out = _answer(first, 10)
    for answer, status in ((over, 503), (timed_out, 408)):
        assert _status(answer) == status, answer[:200]
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert b"\r\nx-frame-options: deny" in head, head
