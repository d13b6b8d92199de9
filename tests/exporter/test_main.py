"""`ampscope serve` for real: a uvicorn process on a loopback port, fed over HTTP."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import DEADLOCK_GUARD_S, free_port

from ampscope.cli import main
from ampscope.exporter import main as serve
from ampscope.exporter.settings import Settings
from exporter.factory import body, record, steps, totals

TOKEN = "tok-123"
MAX_BODY = 64 * 1024


class Server:
    def __init__(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    token_file = tmp_path_factory.mktemp("serve") / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ampscope.cli",
            "serve",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
            "--max-body-bytes",
            str(MAX_BODY),
            "--log-level",
            "info",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    srv = Server(port, proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{srv.url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"ampscope serve did not come up:\n{out}")
        time.sleep(0.1)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _raw(
    port: int, request: bytes, body_chunks: list[bytes] = (), timeout: float = DEADLOCK_GUARD_S
) -> bytes:
    """Send a hand-written HTTP request, then the body chunks as far as the server reads
    them; return whatever the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed before taking the whole body
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_serves_ingest_metrics_and_api_over_http(server: Server) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for rank in range(2):
            response = http.post(
                "/api/v1/ingest", content=body(*steps(1, 5, rank=rank)), headers=auth
            )
            assert (response.json()["accepted"], response.json()["ignored"]) == (5, 0)
        # Step 10 is aligned: each rank's totals carry its scale there, which must agree.
        odd = totals(10, skipped=2, local={"cuda:1": 2}, aligned=(10, 16.0))
        last = record(10, rank=1, scale=16.0, total=odd)
        for rec, dropped in ((last, 3), (record(10, total=totals(10, aligned=(10, 65536.0))), 0)):
            response = http.post("/api/v1/ingest", content=body(rec, dropped=dropped), headers=auth)
            assert response.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        scales = {s.labels["rank"]: s.value for s in families["ampscope_loss_scale"].samples}
        assert scales == {"0": 65536.0, "1": 16.0}
        skipped = {
            s.labels["rank"]: s.value
            for s in families["ampscope_skipped_steps"].samples
            if s.name.endswith("_total")
        }
        assert skipped == {"0": 0.0, "1": 2.0}
        dropped = {
            s.labels["rank"]: s.value
            for s in families["ampscope_reporter_dropped_records"].samples
            if s.name.endswith("_total")
        }
        assert dropped == {"0": 0.0, "1": 3.0}
        health = http.get("/api/v1/runs/run-a/health").json()
        verdicts = {v["rule"]: v for v in health["verdicts"]}
        assert health["status"] == "critical"
        desync = verdicts["scale_desync"]["evidence"]
        assert (desync["newest_mismatched_step"], desync["ranks_at_newest"]) == (10, 2)
        assert verdicts["scale_collapse"]["evidence"]["ranks"][0]["rank"] == 1
        assert http.get("/api/v1/runs/run-a/ranks/1").json()["step"] == 10


def test_bad_requests_over_a_real_socket_then_still_serving(server: Server) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.post("/api/v1/ingest", content=body(record(1))).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            http.post("/api/v1/ingest", content=body(record(1)), headers=wrong).status_code == 401
        )
        assert http.post("/api/v1/ingest", content=b"{nope", headers=auth).status_code == 400
    head = (
        b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nContent-Type: application/json\r\n"
    )
    # Declares 10 GB and sends none of it: a 413, not the 408 that waiting for the body
    # would end in.
    answer = _raw(server.port, head + b"Content-Length: 10000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # Chunked and endless: cut off once past the limit.
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    answer = _raw(server.port, head + b"Transfer-Encoding: chunked\r\n\r\n", [chunk] * 64)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        assert (
            http.post(
                "/api/v1/ingest", content=body(record(1, run="after")), headers=auth
            ).status_code
            == 200
        )
        rejections = {
            s.labels["reason"]: s.value
            for f in text_string_to_metric_families(http.get("/metrics").text)
            if f.name == "ampscope_exporter_ingest_rejections"
            for s in f.samples
            if s.name.endswith("_total")
        }
    assert (rejections["token_missing"], rejections["token_wrong"]) == (1, 1)
    assert rejections["malformed"] == 1
    assert rejections["too_large"] == 2


def test_sigterm_stops_the_server(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    out, _ = server.proc.communicate(timeout=15)
    log = out.decode(errors="replace")
    # uvicorn shuts down gracefully (lifespan included), then re-raises the signal.
    assert server.proc.returncode == -signal.SIGTERM, log
    assert (
        f"ampscope exporter on http://127.0.0.1:{server.port} (ingest needs a bearer token; "
        "reads open)" in log
    )
    assert "Application shutdown complete" in log
    # Each new run's first record, once (run-a's two ranks, then "after").
    firsts = [line for line in log.splitlines() if ": first record, from rank" in line]
    assert firsts == [
        "INFO ampscope.exporter: run 'run-a': first record, from rank 0 of 2 on node node0"
        " (step 1)",
        "INFO ampscope.exporter: run 'after': first record, from rank 0 of 2 on node node0"
        " (step 1)",
    ]
    # Every refusal of test_bad_requests_over_a_real_socket_then_still_serving, in summaries
    # by reason (the first at once, the rest within a minute or at shutdown).
    summaries = re.findall(r"refused (\d+) request\(s\) by reason: ([^(]+)", log)
    assert summaries, log
    counted: dict[str, int] = {}
    for total, reasons in summaries:
        for item in reasons.strip().split(", "):
            n, reason = item.split()
            counted[reason] = counted.get(reason, 0) + int(n)
        assert int(total) == sum(int(item.split()[0]) for item in reasons.strip().split(", "))
    assert counted == {"token_missing": 1, "token_wrong": 1, "malformed": 1, "too_large": 2}
    assert summaries[0] == ("1", "1 token_missing ")  # the first one at once


def test_bad_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--stale-after", "120", "--retention", "60"]) == 2
    assert "retention_s must be at least stale_after_s" in capsys.readouterr().err
    assert main(["serve", "--token-file", "/nonexistent/token"]) == 2
    assert "cannot read token_file" in capsys.readouterr().err


def test_help_states_the_settings_defaults() -> None:
    defaults = Settings.model_fields
    for flag, (field, _, help_) in serve._OPTIONS.items():
        stated = re.search(r"\(default ([^):]+)", help_)
        if stated is None:
            continue
        assert str(defaults[field].default).removesuffix(".0") == stated.group(1), flag


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AMPSCOPE_PORT", "9999")
    monkeypatch.setenv("AMPSCOPE_TOKEN", "  from-env ")
    monkeypatch.setenv("AMPSCOPE_URL", "http://elsewhere:1")  # the ranks' variable: ignored
    settings = Settings()
    assert settings.port == 9999
    assert settings.token is not None
    assert settings.token.get_secret_value() == "from-env"
    token_file = tmp_path / "t"
    token_file.write_text("file-wins\n")
    assert Settings(token_file=token_file).token.get_secret_value() == "file-wins"
    monkeypatch.setenv("AMPSCOPE_TOKEN", " ")
    assert Settings().token is None


def test_serving_never_imports_torch() -> None:
    code = "import sys, ampscope.exporter.app, ampscope.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_port_in_use_exits_at_once_with_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert time.monotonic() - started < 10  # no start-up, no waiting for the port
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert f"port {port} on 127.0.0.1 is in use" in lines[0]
    assert "--port" in lines[0]


def test_help_lists_the_lifecycle_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--stale-after SECONDS seconds without hearing from a rank" in text
    assert "--stall-after SECONDS seconds a rank still heard from" in text
    assert "--finished-retention SECONDS seconds a finished rank's series are kept" in text
