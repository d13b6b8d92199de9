"""A real HTTP/1.1 server on loopback that plays the exporter's ingest endpoint in tests.

It validates every body against the real ``IngestBatch`` schema, records what arrived
and on which TCP connection, can answer the next N requests with a chosen status, and
can be stopped (dropping live connections too) and started again on the same port.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from support import DEADLOCK_GUARD_S

from ampscope.reporter.schema import (
    HEARTBEAT_PATH,
    INGEST_PATH,
    Heartbeat,
    Identity,
    IngestBatch,
    RankTotals,
    StepRecord,
)


def make_record(step: int, *, run: str = "run-a", rank: int = 0) -> StepRecord:
    """A valid record whose cumulative totals say ``step`` steps were taken."""
    return StepRecord(
        identity=Identity(run=run, node="node-0", rank=rank, local_rank=rank, world_size=2),
        step=step,
        time=1_700_000_000.0 + step,
        found_inf_local={"cpu": step % 5 == 0},
        found_inf_origin={},
        found_inf_global=step % 5 == 0,
        skipped=step % 5 == 0,
        scale_before=1024.0,
        scale_after=512.0 if step % 5 == 0 else 1024.0,
        growth_tracker=0,
        event="backoff" if step % 5 == 0 else "none",
        optimizers=[],
        nonfinite_params=[],
        totals=RankTotals(
            steps=step,
            skipped_steps=step // 5,
            backoffs=step // 5,
            growths=0,
            found_inf_local={"cpu": step // 5},
            found_inf_origin={},
            nonfinite_params=[],
            min_scale=512.0,
            max_scale=1024.0,
            aligned_scale=None,
        ),
    )


@dataclass
class Received:
    """One request as the server saw it."""

    connection: int
    """Which TCP connection carried it (numbered from 1 in accept order)."""
    path: str
    headers: dict[str, str]
    batch: IngestBatch | None
    """The parsed body, or None when it failed validation (see ``error``)."""
    status: int
    error: str = ""


@dataclass
class _Failure:
    status: int
    times: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class LoopbackExporter:
    """Ingest endpoint on 127.0.0.1; use as a context manager or call start()/stop()."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self._connections = 0
        self._live: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.heartbeats: list[Heartbeat] = []
        """Valid heartbeats, in arrival order (kept apart from ``received``)."""
        self.heartbeat_bodies: list[bytes] = []
        """Every heartbeat's body as it arrived, valid or not, in arrival order."""
        self.unknown_heartbeat_fields: set[str] = set()
        """Heartbeat fields to answer 422 to, as an exporter that predates them does (the
        schema refuses unknown fields)."""
        self.events: list[str] = []
        """``records`` or ``beat``/``final`` per answered 200, in arrival order; a heartbeat
        that was not applied (no record of its rank held) as ``beat?``/``final?``, one
        refused for ``unknown_heartbeat_fields`` as ``refused``."""
        self.heartbeat_interval_s: float | None = None
        """Sent back as ``heartbeat_interval_s`` in every 200, as the exporter does."""
        self.held: set[tuple[str, int]] = set()
        """(run, rank) of every accepted record: a heartbeat of any other is not applied."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LoopbackExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LoopbackExporter:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler_for(self))
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection, as a killed exporter would."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            live, self._live = self._live, set()
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        assert self._thread is not None
        self._thread.join()

    def fail_next(
        self,
        status: int,
        times: int = 1,
        *,
        detail: Any = "injected failure",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next ``times`` ingest requests with ``status`` and a JSON ``detail``."""
        body = json.dumps({"detail": detail}).encode()
        with self._lock:
            self._failures.append(_Failure(status, times, body, dict(headers or {})))

    def forget(self) -> None:
        """Drop every rank held, as a restarted exporter has (its store is in memory)."""
        with self._lock:
            self.held.clear()

    def steps(self, status: int = 200) -> list[int]:
        """Steps of every record accepted (or answered with ``status``), in arrival order."""
        with self._lock:
            return [
                record.step
                for req in self.received
                if req.status == status and req.batch is not None
                for record in req.batch.records
            ]

    def accepted(self) -> list[IngestBatch]:
        with self._lock:
            return [r.batch for r in self.received if r.status == 200 and r.batch is not None]

    def wait_until(self, predicate: Callable[[], bool], timeout: float = DEADLOCK_GUARD_S) -> bool:
        """Whether ``predicate`` came true within ``timeout`` (polled every 10 ms). Pass a
        short ``timeout`` only to check that something does not happen."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    # ---- called by the handler ----

    def _open(self, sock: socket.socket) -> int:
        with self._lock:
            self._connections += 1
            self._live.add(sock)
            return self._connections

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.discard(sock)

    def _answer(
        self, connection: int, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, dict[str, str]]:
        try:
            batch: IngestBatch | None = IngestBatch.model_validate_json(body)
            error = ""
        except ValueError as exc:
            batch, error = None, str(exc)
        if path == HEARTBEAT_PATH:
            return self._heartbeat(body)
        with self._lock:
            if path != INGEST_PATH:
                status, payload, extra = 404, b'{"detail":"Not Found"}', {}
            elif self._failures:
                failure = self._failures[0]
                failure.times -= 1
                if failure.times <= 0:
                    self._failures.pop(0)
                status, payload, extra = failure.status, failure.body, failure.headers
            elif batch is None:
                status, payload, extra = 422, json.dumps({"detail": error}).encode(), {}
            else:
                answer: dict[str, Any] = {"accepted": len(batch.records)}
                if self.heartbeat_interval_s is not None:
                    answer["heartbeat_interval_s"] = self.heartbeat_interval_s
                status, payload, extra = 200, json.dumps(answer).encode(), {}
                self.events.append("records")
                self.held.update((r.identity.run, r.identity.rank) for r in batch.records)
            self.received.append(Received(connection, path, headers, batch, status, error))
        return status, payload, extra

    def _heartbeat(self, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        with self._lock:
            self.heartbeat_bodies.append(body)
            try:
                unknown = self.unknown_heartbeat_fields & set(json.loads(body))
            except ValueError:
                unknown = set()
            if unknown:
                self.events.append("refused")
        if unknown:
            detail = f"extra inputs are not permitted: {sorted(unknown)}"
            return 422, json.dumps({"detail": detail}).encode(), {}
        try:
            beat = Heartbeat.model_validate_json(body)
        except ValueError as exc:
            return 422, json.dumps({"detail": str(exc)}).encode(), {}
        with self._lock:
            self.heartbeats.append(beat)
            applied = (beat.identity.run, beat.identity.rank) in self.held
            self.events.append(("final" if beat.final else "beat") + ("" if applied else "?"))
            answer: dict[str, Any] = {"applied": applied}
            if self.heartbeat_interval_s is not None:
                answer["heartbeat_interval_s"] = self.heartbeat_interval_s
        return 200, json.dumps(answer).encode(), {}


def _handler_for(owner: LoopbackExporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn does

        def setup(self) -> None:
            super().setup()
            self.connection_number = owner._open(self.connection)

        def finish(self) -> None:
            owner._close(self.connection)
            super().finish()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            status, payload, extra = owner._answer(
                self.connection_number, self.path, dict(self.headers.items()), body
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output quiet

    return Handler
