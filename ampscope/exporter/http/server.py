"""The HTTP server under the app: uvicorn's httptools protocol with the limits it lacks.

uvicorn (0.54) times out idle kept-alive connections only: a connection that never
finishes its request headers, or that never sends anything, is held forever, and
``limit_concurrency`` answers 503 only once headers are complete, so slowloris
connections still pile up until the process runs out of file descriptors (the
request-start and request-complete timeouts of uvicorn issue #157 were never added).
ASGI middleware cannot help: it runs once headers are complete. This protocol
subclass adds, per connection:

* a header timeout: the request line and headers must arrive within
  ``header_timeout_s`` of the connection opening or of the request's first byte,
  else 408 and close;
* a body timeout backstop: a body nobody reads (a GET or a 404 with a dribbled body)
  must end within ``body_timeout_s`` plus a grace second, else close; the ingest route
  answers 408 itself at ``body_timeout_s`` (``ampscope.exporter.http.body``);
* a connection cap: beyond ``max_connections`` open ones, 503 at once, before reading;
* uvicorn's own 400 for unparseable HTTP answered with the JSON ``ErrorBody``;
* under TLS, a client certificate without any of the web config's ``client_allowed_sans``
  is cut at once (Python's ssl has no hook inside the handshake for it).

Its own answers carry the web config's headers too.

Each cut is counted in ``ampscope_exporter_ingest_rejections_total{reason}``.
Everything else (parsing, keep-alive, flow control, the ASGI cycle) is uvicorn's.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ampscope.exporter.api.errors import ApiError
from ampscope.exporter.security.policy import WebSecurity
from ampscope.exporter.security.tls import peer_san_refused
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ingest_counters import IngestStats

log = logging.getLogger("ampscope.exporter")

BODY_GRACE_S = 1.0
"""The backstop closes a body this long after the ingest route's own 408 would have."""
REFUSED_LINGER_S = 1.0
"""After a 408/503, how long the request's remaining bytes are read and dropped, so the
client reads the answer instead of a connection reset."""
OVER_CAPACITY_RETRY_AFTER_S = 1


def error_response(answer: ApiError, headers: dict[str, str] | None = None) -> bytes:
    """``answer`` as a complete ``Connection: close`` HTTP/1.1 response carrying its
    ``ErrorBody``, with ``headers`` under its own."""
    body = answer.body.model_dump_json(exclude_none=True)
    lines = [
        f"HTTP/1.1 {answer.status} {http.HTTPStatus(answer.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in ((headers or {}) | (answer.headers or {})).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus header/body timeouts and a connection cap.

    Configured through class attributes by ``guarded_protocol``, because uvicorn
    builds one instance per connection with its own fixed arguments.
    """

    settings: ClassVar[Settings]
    stats: ClassVar[IngestStats]
    security: ClassVar[WebSecurity | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        self._refused = False

    # Connection lifetime --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refused = peer_san_refused(transport.get_extra_info("ssl_object"))
        if refused is not None:
            self.stats.rejected("client_san")
            log.warning("TLS connection from %s cut: %s", self.client, refused)
            self._refused = True
            transport.abort()
            return
        cap = self.settings.max_connections
        if len(self.connections) > cap:
            self.stats.rejected("over_capacity")
            self._refuse(
                ApiError(
                    503,
                    "over_capacity",
                    f"the exporter holds max_connections={cap} open connections; retry shortly",
                    headers={"Retry-After": str(OVER_CAPACITY_RETRY_AFTER_S)},
                    limit="max_connections",
                    value=cap,
                )
            )
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the answer is written; drop the rest until close
        # Any byte between requests (even a stray CRLF, which starts no message) starts
        # the clock, so bytes dribbled between requests cannot keep a connection forever.
        if self._awaiting_headers and self._header_timer is None:
            self._arm_header_timer()
        super().data_received(data)

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()

    # httptools parser callbacks --------------------------------------------------------

    def on_message_begin(self) -> None:
        self._awaiting_headers = True
        if self._header_timer is None:
            self._arm_header_timer()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._cancel(self._header_timer)
        self._header_timer = None
        # Cancelled by on_message_complete: at once for a request without a body.
        self._body_timer = self.loop.call_later(
            self.settings.body_timeout_s + BODY_GRACE_S, self._on_body_timeout
        )
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel(self._body_timer)
        self._body_timer = None
        self._awaiting_headers = True
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self.stats.rejected("malformed")
        self._refuse(ApiError(400, "malformed", f"unparseable HTTP request: {msg}"))

    # Timers ---------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(
            self.settings.header_timeout_s, self._on_header_timeout
        )

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self._refused:
            return
        self.stats.rejected("header_timeout")
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request stalled behind a response still being written.
            self.transport.close()
            return
        self._refuse(
            ApiError(
                408,
                "header_timeout",
                f"request headers not complete within header_timeout_s="
                f"{self.settings.header_timeout_s:g}",
                limit="header_timeout_s",
                value=self.settings.header_timeout_s,
            )
        )

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        # Reached only when the app did not read (and answer) the body in time itself.
        self.stats.rejected("body_timeout")
        self.transport.close()

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _refuse(self, answer: ApiError) -> None:
        """Answer with ``answer``'s ``ErrorBody`` and close, dropping whatever else arrives."""
        self._refused = True
        self._cancel_timers()
        headers = dict(self.security.config.headers) if self.security is not None else None
        self.transport.write(error_response(answer, headers))
        # Closing with unread bytes makes the kernel send a reset, which can destroy the
        # answer in flight: half-close, drain briefly, then close.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
        else:
            self.transport.close()


def guarded_protocol(
    settings: Settings, stats: IngestStats, security: WebSecurity | None = None
) -> type[GuardedHttpProtocol]:
    """A ``GuardedHttpProtocol`` subclass bound to ``settings``, ``stats`` and the web
    config in force, for ``uvicorn.Config(http=...)``."""
    return type(
        "BoundGuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"settings": settings, "stats": stats, "security": security},
    )
