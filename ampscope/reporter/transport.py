"""One kept-alive HTTP connection to the exporter's ingest endpoint.

Standard library only (``http.client``): the rank side never imports an HTTP client
package or the server stack. The reporter's background thread is the only caller of
``post``; ``abort`` may be called from any thread to unblock it.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import json
import os
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from ampscope.reporter.schema import DEFAULT_URL, INGEST_PATH
from ampscope.reporter.tls import TOKEN_ENV, ClientTls, explain_401, explain_tls_failure

__all__ = ["TOKEN_ENV", "URL_ENV", "IngestTransport", "Outcome", "PostResult", "url_from_env"]

URL_ENV = "AMPSCOPE_URL"
"""Where ranks report; ``off`` disables reporting (the scalers read it for ``reporter="auto"``)."""
OFF_VALUES = frozenset({"off", "none", "false", "0", "disabled"})

_ERROR_BODY_LIMIT = 512
# What a server closing an idle keep-alive connection looks like to the next request.
_STALE_CONNECTION_ERRORS = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
)


def url_from_env() -> str | None:
    """The exporter URL ranks report to, from ``AMPSCOPE_URL``.

    Returns:
        ``AMPSCOPE_URL`` when set, ``DEFAULT_URL`` when unset or empty, and ``None`` when it
        says ``off`` (reporting disabled).
    """
    value = os.environ.get(URL_ENV, "").strip()
    if not value:
        return DEFAULT_URL
    if value.lower() in OFF_VALUES:
        return None
    return value


class Outcome(enum.Enum):
    """What the reporter should do with a batch after one POST."""

    DELIVERED = "delivered"
    """2xx: the exporter accepted every record."""
    RETRY = "retry"
    """Connection error, timeout, 408, 429 or 5xx: send the same records again later."""
    TOO_LARGE = "too_large"
    """413: send fewer records per request."""
    REJECTED = "rejected"
    """Any other status: the exporter will never accept these records; drop them."""


@dataclass(frozen=True, kw_only=True)
class PostResult:
    """The result of one POST."""

    outcome: Outcome
    status: int | None
    """HTTP status, or ``None`` when no response arrived."""
    detail: str
    """The server's error (JSON ``detail`` when it sent one) or the connection error."""
    retry_after: float | None = None
    """Seconds from a ``Retry-After`` header (429/503), when the server sent one."""
    heartbeat_interval: float | None = None
    """The exporter's ``heartbeat_interval_s`` from a 2xx answer, when it sent one."""
    applied: bool | None = None
    """A heartbeat's 2xx answer's ``applied``: ``False`` when the exporter holds no record
    of the rank (it restarted, or retention dropped the rank); ``None`` when not said."""
    refused: bool = False
    """The exporter refused us (401, or TLS: untrusted server, client certificate missing
    or refused); ``detail`` says why in words."""


def classify(status: int) -> Outcome:
    """Map an HTTP status to what the reporter does next."""
    if 200 <= status < 300:
        return Outcome.DELIVERED
    if status in (408, 429) or status >= 500:
        return Outcome.RETRY
    if status == 413:
        return Outcome.TOO_LARGE
    return Outcome.REJECTED


class IngestTransport:
    """POSTs ingest batches over one persistent connection, reconnecting when it breaks.

    Args:
        url: Exporter base URL (``http://host:port`` or ``https://…``, optionally with a
            path prefix); batches go to ``{url}/api/v1/ingest``.
        token: Bearer token for the ``Authorization`` header, or ``None``.
        timeout: Socket timeout in seconds for connecting and for each read/write.
        tls: For an ``https://`` URL: the CA to trust and the client certificate to show;
            ``None``: the system's trust store, no client certificate.

    Raises:
        ValueError: an invalid URL, or TLS files that cannot be loaded.
    """

    def __init__(
        self, url: str, *, token: str | None, timeout: float, tls: ClientTls | None = None
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"exporter URL must look like http://host:port, got {url!r}")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"exporter URL has an invalid port: {url!r}") from exc
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = port
        self._prefix = parts.path.rstrip("/")
        self._timeout = timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._tls = tls or ClientTls()
        self._context = self._tls.context() if parts.scheme == "https" else None
        self._fresh = False
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _conn against abort() from another thread
        self.connections_opened = 0
        """How many TCP connections ``post`` has opened (keep-alive keeps this at 1)."""

    def post(
        self, body: bytes, *, timeout: float | None = None, path: str = INGEST_PATH
    ) -> PostResult:
        """Send one batch and read the whole response (so the connection can be reused).

        A request that fails on a reused connection is retried once at once on a fresh
        one: the server may have closed an idle keep-alive connection, which is not a
        failure of the exporter.

        Args:
            body: The JSON ``IngestBatch``.
            timeout: Socket timeout for this request, at most the constructor's timeout;
                used near a close() deadline.
            path: The exporter endpoint, ``INGEST_PATH`` or ``HEARTBEAT_PATH``.
        """
        limit = self._timeout if timeout is None else max(0.001, min(timeout, self._timeout))
        reused = self._conn is not None
        target = self._prefix + path
        try:
            return self._attempt(body, limit, target)
        except _STALE_CONNECTION_ERRORS as exc:
            self.close()
            if not reused:
                return self._failed(exc)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return self._failed(exc)
        try:
            return self._attempt(body, limit, target)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return self._failed(exc)

    def _failed(self, exc: BaseException) -> PostResult:
        """A RETRY result for ``exc``, saying in words when it was a TLS refusal."""
        refusal = None
        if self._context is not None:
            refusal = explain_tls_failure(
                exc, fresh=self._fresh, client_cert=self._tls.cert_file is not None
            )
        return PostResult(
            outcome=Outcome.RETRY,
            status=None,
            detail=refusal or _describe(exc),
            refused=refusal is not None,
        )

    def abort(self) -> None:
        """Shut the socket down so that a ``post`` blocked on it returns at once.

        Safe to call from any thread; the next ``post`` reconnects.
        """
        with self._lock:
            conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing to unblock
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = self._conn
        self._fresh = conn is None
        if conn is None:
            if self._context is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout, context=self._context
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            conn.connect()
            self.connections_opened += 1
            with self._lock:
                self._conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _attempt(self, body: bytes, timeout: float, path: str) -> PostResult:
        conn = self._connection(timeout)
        conn.request("POST", path, body=body, headers=self._headers)
        response = conn.getresponse()
        payload = response.read()
        if response.will_close:
            self.close()
        outcome = classify(response.status)
        delivered = outcome is Outcome.DELIVERED
        answer = _answer(payload) if delivered else {}
        refused = response.status == 401
        if refused:
            server = _error_detail(payload)
            detail = explain_401(response.getheader("WWW-Authenticate"))
            detail += f" (the exporter says: {server})" if server else ""
        else:
            detail = "" if delivered else _error_detail(payload)
        return PostResult(
            outcome=outcome,
            status=response.status,
            detail=detail,
            refused=refused,
            retry_after=_retry_after(response.getheader("Retry-After")),
            heartbeat_interval=_heartbeat_interval(answer),
            applied=_applied(answer),
        )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_detail(payload: bytes) -> str:
    """The server's error message: FastAPI's JSON ``detail`` when present, else the text."""
    text = payload[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(payload)
    except ValueError:
        return text
    if isinstance(parsed, dict) and "detail" in parsed:
        return json.dumps(parsed["detail"])[:_ERROR_BODY_LIMIT]
    return text


def _answer(payload: bytes) -> dict[str, object]:
    """A 2xx answer's JSON object, or an empty dict when it is not one."""
    if b"heartbeat_interval_s" not in payload and b"applied" not in payload:
        return {}  # nothing the reporter reads: skip parsing
    try:
        parsed = json.loads(payload)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _heartbeat_interval(answer: dict[str, object]) -> float | None:
    # The exporter's answer says how often it needs to hear from an idle rank.
    value = answer.get("heartbeat_interval_s")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _applied(answer: dict[str, object]) -> bool | None:
    value = answer.get("applied")
    return value if isinstance(value, bool) else None


def _retry_after(value: str | None) -> float | None:
    # Only the delta-seconds form; an HTTP date is rare from an exporter and not worth parsing.
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
