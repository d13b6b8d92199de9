"""A real HTTP server on loopback that answers what a test tells it and records what it got.

It stands in for an exporter or a Prometheus that answers JSON of the wrong shape, or that
redirects elsewhere: each path (a query string is ignored) maps to a ``Reply``, and every
request's method, path and headers are recorded, in order, for the test to read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One answer: ``body`` (JSON unless ``raw``), or a redirect to ``location``."""

    body: Any = None
    status: int = 200
    location: str | None = None
    raw: bytes | None = None


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeApi:
    """The server's routes and what it received; ``url`` once it serves."""

    routes: dict[str, Reply] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    url: str = ""

    def authorizations(self) -> list[str | None]:
        """The ``Authorization`` header of each request received, in order."""
        return [r.headers.get("authorization") for r in self.received]


def _handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            path = self.path.split("?", 1)[0]
            api.received.append(
                Received(self.command, path, {k.lower(): v for k, v in self.headers.items()})
            )
            reply = api.routes.get(path, Reply({"error": "not_found"}, 404))
            if reply.location is not None:
                self.send_response(reply.status)
                self.send_header("Location", reply.location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _answer
        do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the test reads ``received``

    return Handler


@contextmanager
def serving(routes: dict[str, Reply] | None = None) -> Iterator[FakeApi]:
    """A ``FakeApi`` serving on 127.0.0.1 (a free port) until the block ends."""
    api = FakeApi(routes=dict(routes or {}))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
