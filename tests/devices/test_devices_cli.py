"""``ampscope devices`` as a user runs it, against a loopback server answering as Prometheus
would, or as a broken one would: the shape of every answer is checked, and a malformed one
is one line on stderr and exit status 7 (3 for an error answer), never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support import free_port

Answer = Callable[[str], tuple[int, bytes]]
"""PromQL -> (HTTP status, body)."""


class FakePrometheus:
    """A real HTTP server on loopback whose ``/api/v1/query`` answers with ``answer``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.queries: list[str] = []
        self.authorizations: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                promql = form["query"][0]
                outer.queries.append(promql)
                outer.authorizations.append(self.headers.get("Authorization", ""))
                status, body = outer.answer(promql)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePrometheus:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _vector(*samples: tuple[dict[str, str], str]) -> bytes:
    result = [{"metric": labels, "value": [1.7e9, value]} for labels, value in samples]
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": result}}
    ).encode()


def _offence(run: str, device: str, node: str, count: str, kind: str = "nonfinite_origin") -> tuple:
    return ({"run": run, "device": device, "node": node, "kind": kind}, count)


GOOD_OFFENCES = _vector(
    _offence("r1", "GPU-aa", "n1", "2"),
    _offence("r2", "GPU-aa", "n1", "1", "transient_fault"),
    _offence("r2", "n2:0", "n2", "1"),
    # An older exporter's origin_outlier series: no offence, r3 no run of GPU-aa's.
    _offence("r3", "GPU-aa", "n1", "3", "origin_outlier"),
)


def _answers(offences: bytes, last: bytes = _vector(), dcgm: bytes = _vector()) -> Answer:
    def answer(promql: str) -> tuple[int, bytes]:
        if "ampscope_device_offences_total" in promql:
            return 200, offences
        if "ampscope_device_last_offence_timestamp_seconds" in promql:
            return 200, last
        return 200, dcgm

    return answer


def devices(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "devices", "--prometheus", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def good() -> Iterator[FakePrometheus]:
    last = _vector(({"run": "r2", "device": "GPU-aa", "node": "n1"}, "1700000000"))
    dcgm = _vector(
        ({"UUID": "GPU-aa", "field": "DCGM_FI_DEV_XID_ERRORS"}, "79"),
        ({"UUID": "GPU-aa", "field": "DCGM_FI_DEV_ROW_REMAP_FAILURE"}, "0"),
        ({"UUID": "GPU-zz", "field": "DCGM_FI_DEV_XID_ERRORS"}, "13"),  # never offended
    )
    with FakePrometheus(_answers(GOOD_OFFENCES, last, dcgm)) as server:
        yield server


def test_a_repeat_offender_is_listed_first_with_its_dcgm_errors_and_exit_1(
    good: FakePrometheus,
) -> None:
    done = devices(good.url, "--json", "--since", "7d")
    assert done.returncode == 1, done.stderr
    listed = json.loads(done.stdout)
    assert [(d["device"], d["node"], d["runs"], d["flagged"]) for d in listed] == [
        ("GPU-aa", "n1", 2, True),
        ("n2:0", "n2", 1, False),
    ]
    assert listed[0]["offences"] == {
        "nonfinite_origin": 2,
        "transient_fault": 1,
        "replica_divergence": 0,
    }
    assert listed[0]["last_run"] == "r2"
    assert listed[0]["dcgm"] == {"DCGM_FI_DEV_XID_ERRORS": 79.0}
    # The window is the offences'; DCGM's fields are read as they are now.
    assert sum("[7d]" in promql for promql in good.queries) == 2
    table = devices(good.url)
    assert table.returncode == 1
    lines = table.stdout.splitlines()
    header = next(line for line in lines if "DEVICE" in line)
    assert header.split() == [
        "DEVICE", "NODE", "RUNS", "NONFINITE_ORIGIN", "TRANSIENT_FAULT",
        "REPLICA_DIVERGENCE", "LAST", "RUN", "LAST", "OFFENCE", "DCGM",
    ]  # fmt: skip
    first = lines[lines.index(header) + 1].split()
    assert first[:8] == ["!", "GPU-aa", "n1", "2", "2", "1", "0", "r2"]
    assert first[-1] == "xid_errors=79"
    assert "1 device(s) offended in 2 or more runs (!)" in table.stdout


def test_the_threshold_is_settable(good: FakePrometheus) -> None:
    done = devices(good.url, "--min-runs", "3", "--json")
    assert done.returncode == 0, done.stderr
    assert [d["flagged"] for d in json.loads(done.stdout)] == [False, False]


def test_no_offence_at_all_is_exit_0() -> None:
    with FakePrometheus(_answers(_vector())) as server:
        done = devices(server.url)
    assert done.returncode == 0
    assert "no device offended." in done.stdout


MALFORMED = {
    "not JSON": (200, b"<html>proxy error</html>", "not JSON (it begins '<html>proxy", 7),
    "a JSON list": (200, b"[]", "expected an object, got an array ([])", 7),
    "an error": (
        200,
        b'{"status":"error","errorType":"bad_data","error":"parse error at char 3"}',
        "answered an error: parse error at char 3",
        3,
    ),
    "a matrix": (
        200,
        b'{"status":"success","data":{"resultType":"matrix","result":[]}}',
        'data.resultType: expected "vector", got a string ("matrix")',
        7,
    ),
    "no result list": (
        200,
        b'{"status":"success","data":{"resultType":"vector","result":{}}}',
        "data.result: expected a list of samples",
        7,
    ),
    "a sample without a value": (
        200,
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{}}]}}',
        "the key 'value' is missing",
        7,
    ),
    "a value that is not a number": (
        200,
        _vector(_offence("r1", "GPU-aa", "n1", "many")),
        'expected a number as a string, got a string ("many")',
        7,
    ),
    "a NaN value": (
        200,
        _vector(_offence("r1", "GPU-aa", "n1", "NaN")),
        "data.result[0].value[1] is nan, not a finite number",
        7,
    ),
    "a value past a float's range": (
        200,
        _vector(_offence("r1", "GPU-aa", "n1", "1e400")),
        "data.result[0].value[1] is inf, not a finite number",
        7,
    ),
    "a sample without its labels": (
        200,
        _vector(({"run": "r1", "device": "GPU-aa"}, "1")),
        "data.result[0] has no node, kind label",
        7,
    ),
    "HTTP 500": (500, b"internal error", "answered HTTP 500: internal error", 3),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_answer_is_one_line_and_its_exit_status(case: str) -> None:
    """Exit 7 for an answer of the wrong shape (as ``ampscope status``), 3 for an error."""
    status, body, said, code = MALFORMED[case]
    with FakePrometheus(_answers_all(status, body)) as server:
        done = devices(server.url)
    assert done.returncode == code, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"ampscope devices: {server.url}"), done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr


def _answers_all(status: int, body: bytes) -> Answer:
    return lambda promql: (status, body)


def test_a_malformed_dcgm_answer_is_exit_7_too() -> None:
    broken = _vector(({"UUID": "GPU-aa"}, "79"))  # no field label: not our query's answer
    with FakePrometheus(_answers(GOOD_OFFENCES, _vector(), broken)) as server:
        done = devices(server.url)
    assert done.returncode == 7
    assert "(DCGM) answered JSON of the wrong shape: data.result[0] has no field" in done.stderr


def test_refused_credentials_are_exit_5_and_no_server_is_exit_3() -> None:
    with FakePrometheus(_answers_all(401, b"unauthorized")) as server:
        done = devices(server.url)
    assert done.returncode == 5
    assert "refused the request (HTTP 401)" in done.stderr
    gone = devices(f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 3
    assert "no Prometheus answers at" in gone.stderr
    assert devices("http://127.0.0.1:1", "--since", "30 days").returncode == 2  # usage


def test_the_bearer_token_is_sent(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with FakePrometheus(_answers(_vector())) as server:
        done = devices(server.url, "--bearer-token-file", str(token))
    assert done.returncode == 0, done.stderr
    assert server.authorizations == ["Bearer s3cret"] * 3


def test_an_old_namespace_exporter_never_fails_the_fleet() -> None:
    """One node's dcgm-exporter runs with --use-old-namespace (uuid), another's series lack
    any UUID: the first joins, the second is left out with a warning, exit by the offences."""
    dcgm = _vector(
        ({"uuid": "GPU-aa", "field": "DCGM_FI_DEV_XID_ERRORS", "Hostname": "host-1"}, "79"),
        ({"gpu": "3", "field": "DCGM_FI_DEV_XID_ERRORS", "instance": "n9:9400"}, "13"),
    )
    with FakePrometheus(_answers(GOOD_OFFENCES, _vector(), dcgm)) as server:
        done = devices(server.url, "--json")
    assert done.returncode == 1, done.stderr
    listed = json.loads(done.stdout)
    assert (listed[0]["device"], listed[0]["hostname"]) == ("GPU-aa", "host-1")
    assert listed[0]["dcgm"] == {"DCGM_FI_DEV_XID_ERRORS": 79.0}
    assert done.stderr == (
        "ampscope devices: warning: left out 1 DCGM-exporter series without a UUID or uuid "
        "label (the first: DCGM_FI_DEV_XID_ERRORS of n9:9400)\n"
    )
