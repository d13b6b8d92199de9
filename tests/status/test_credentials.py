"""Credentials stay with their host: ``ampscope status`` sends basic auth or a bearer token to
the origin (scheme, host, port) it was given, follows a redirect within it with them, and one
to another origin without them; over plain http:// to another machine it warns once.

Loopback servers (``fake_api``) record the headers they receive; ``ampscope status`` runs as a
user runs it.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from fake_api import Reply, serving
from status_cli import run_status
from support import free_port

from ampscope.status.prometheus import queries
from ampscope.status.transport import origin
from ampscope.verdicts.thresholds import Thresholds

BASIC = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
NO_RUNS = Reply([])
EMPTY_VECTOR = Reply({"status": "success", "data": {"resultType": "vector", "result": []}})


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "password"
    path.write_text("s3cret\n")
    return path


def _basic(password_file: Path) -> tuple[str, ...]:
    return ("--user", "prometheus", "--password-file", str(password_file))


def test_a_redirect_to_another_port_gets_no_credentials(password_file: Path) -> None:
    with serving({"/api/v1/runs": NO_RUNS}) as elsewhere, serving() as exporter:
        exporter.routes["/api/v1/runs"] = Reply(status=302, location=f"{elsewhere.url}/api/v1/runs")
        result = run_status("--url", exporter.url, *_basic(password_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no runs")
    assert exporter.authorizations() == [BASIC]
    assert [r.path for r in elsewhere.received] == ["/api/v1/runs"]
    assert elsewhere.authorizations() == [None]
    assert "warning" not in result.stderr  # loopback: nothing crosses a network


def test_a_redirect_within_the_origin_keeps_them(password_file: Path) -> None:
    with serving({"/api/v1/runs": Reply(status=308, location="/moved/api/v1/runs"),
                  "/moved/api/v1/runs": NO_RUNS}) as exporter:  # fmt: skip
        result = run_status("--url", exporter.url, *_basic(password_file))
    assert result.returncode == 0, result.stderr
    assert [r.path for r in exporter.received] == ["/api/v1/runs", "/moved/api/v1/runs"]
    assert exporter.authorizations() == [BASIC, BASIC]


def test_once_gone_they_do_not_come_back_within_the_chain(password_file: Path) -> None:
    with serving({"/back": NO_RUNS}) as exporter, serving() as elsewhere:
        exporter.routes["/api/v1/runs"] = Reply(status=302, location=f"{elsewhere.url}/hop")
        elsewhere.routes["/hop"] = Reply(status=302, location=f"{exporter.url}/back")
        result = run_status("--url", exporter.url, *_basic(password_file))
    assert result.returncode == 0, result.stderr
    assert [(r.path, r.headers.get("authorization")) for r in exporter.received] == [
        ("/api/v1/runs", BASIC),
        ("/back", None),
    ]
    assert elsewhere.authorizations() == [None]


def test_a_bearer_token_stays_with_prometheus(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    with serving({"/api/v1/query": EMPTY_VECTOR}) as elsewhere, serving() as prometheus:
        prometheus.routes["/api/v1/query"] = Reply(
            status=302, location=f"{elsewhere.url}/api/v1/query"
        )
        result = run_status("--prometheus", prometheus.url, "--bearer-token-file", str(token))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no runs")
    assert set(prometheus.authorizations()) == {"Bearer t0ken"}
    # Every query (the published thresholds first, then the answer's own) was redirected,
    # and each went on without the token.
    asked = 1 + len(queries(None, Thresholds()))
    assert len(elsewhere.received) == len(prometheus.received) == asked
    assert set(elsewhere.authorizations()) == {None}


def test_origins() -> None:
    assert origin("http://node7:9478/api") == ("http", "node7", 9478)
    assert origin("HTTP://Node7/x") == origin("http://node7:80/y")
    assert origin("https://node7/x") == ("https", "node7", 443)
    assert origin("https://node7:9478") != origin("http://node7:9478")  # https -> http
    assert origin("http://node7:9478") != origin("http://node7:9479")
    assert origin("http://node7:9478") != origin("http://node8:9478")


def test_credentials_over_plain_http_to_another_machine_warn_once(password_file: Path) -> None:
    # A name that never resolves: the warning comes before any connection is tried.
    far = f"http://ampscope-test.invalid:{free_port()}"
    other = f"http://ampscope-test-2.invalid:{free_port()}"
    result = run_status("--url", far, "--url", other, *_basic(password_file))
    assert result.returncode == 3
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"ampscope status: warning: basic-auth credentials sent to {far} (and 1 more) over "
        "plain http://, readable by anyone on the network path; use https:// "
        "(tls_server_config in the server's web config)"
    ]
    # Without credentials there is nothing to warn of.
    assert "warning" not in run_status("--url", far).stderr
