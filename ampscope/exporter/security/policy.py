"""The web config in force: who is checked where, response headers, and reload.

* ``WebSecurity`` holds the current parse of ``--web-config-file`` and the TLS context the
  listener uses; ``reload`` swaps both, whole, or keeps the old ones when the file has
  become invalid.
* ``SecurityMiddleware`` adds the file's headers to every response and asks for basic auth
  on every path but ``/healthz`` (open, for liveness probes) and ingest/heartbeat (ranks
  authenticate with the bearer token and, when the file requires one, their certificate).
* ``watch`` re-reads the file and the certificates it names when their contents change
  (Kubernetes rotates a Secret without a signal) and at once on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from ampscope.exporter.api.models import ErrorBody
from ampscope.exporter.security.basic_auth import BasicAuthVerifier, parse_basic
from ampscope.exporter.security.tls import RotatingContext, build_context
from ampscope.exporter.security.webconfig import WebConfig, WebConfigError, load
from ampscope.reporter.schema import HEARTBEAT_PATH, INGEST_PATH

log = logging.getLogger("ampscope.exporter")

POLL_INTERVAL_S = 2.0
"""How often the file and its certificates are checked for changes: rotation shows within
this long, well inside the 10 s promised."""
OPEN_PATHS = frozenset({"/healthz"})
TOKEN_PATHS = frozenset({INGEST_PATH, HEARTBEAT_PATH})
BASIC_CHALLENGE = 'Basic realm="ampscope", charset="UTF-8"'

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _files(path: Path, config: WebConfig | None) -> list[Path]:
    """The file and every file it names."""
    files = [path]
    if config is not None and config.tls is not None:
        tls = config.tls
        files += [tls.cert_file, tls.key_file]
        if tls.client_ca_file is not None:
            files.append(tls.client_ca_file)
    return files


def _file_digest(file: Path) -> bytes:
    try:
        return hashlib.sha256(file.read_bytes()).digest()
    except OSError as exc:
        return hashlib.sha256(repr(exc).encode()).digest()


def _combined(digests: list[bytes]) -> bytes:
    return hashlib.sha256(b"".join(digests)).digest()


def _fingerprint(path: Path, config: WebConfig | None) -> bytes:
    """SHA-256 over the file and every file it names: changes when any of them does."""
    return _combined([_file_digest(file) for file in _files(path, config)])


def _load_fingerprinted(path: Path, digests: dict[Path, bytes]) -> tuple[WebConfig, bytes]:
    """``load(path)`` and the fingerprint of what it is read from, each file digested before
    it is read (``digests`` holds those digested already; the certificates are read after
    this returns, by ``build_context``). A change landing after a read then differs from
    the fingerprint recorded, and the next poll reloads. Raises ``WebConfigError``."""
    if path not in digests:
        digests[path] = _file_digest(path)
    config = load(path)
    files = _files(path, config)
    for file in files:
        if file not in digests:
            digests[file] = _file_digest(file)
    return config, _combined([digests[file] for file in files])


class WebSecurity:
    """The web configuration in force and the TLS context built from it.

    Args:
        config: A parse of the file.
        path: The file, re-read by ``reload``.
        fingerprint: Of the files ``config`` was read from, taken before they were read;
            ``None``: taken now.

    Raises:
        WebConfigError: a certificate of ``config`` cannot be loaded.
    """

    def __init__(self, config: WebConfig, path: Path, fingerprint: bytes | None = None) -> None:
        self.path = path
        self.config = config
        self.tls: RotatingContext | None = None
        if config.tls is not None:
            self.tls = RotatingContext(build_context(config.tls))
        self.verifier = BasicAuthVerifier()
        self.header_items = _header_items(config)
        self._fingerprint = fingerprint or _fingerprint(path, config)
        self._failed: bytes | None = None
        self.reloads = 0
        """Successful reloads so far."""

    @classmethod
    def from_file(cls, path: Path) -> WebSecurity:
        """Parse ``path`` and load its certificates. Raises ``WebConfigError``."""
        config, fingerprint = _load_fingerprinted(path, {})
        return cls(config, path, fingerprint)

    def changed(self) -> bool:
        """Whether the file or a certificate it names differs from the last one read."""
        current = _fingerprint(self.path, self.config)
        return current not in (self._fingerprint, self._failed)

    def reload(self) -> bool:
        """Re-read the file and its certificates; swap them in when valid.

        Returns:
            True when the new configuration is in force (for new connections and requests);
            False when it is invalid, which is logged, and the old one stays.
        """
        # Each file is fingerprinted before it is read: a change that lands after the read
        # is then a change from what was applied, and the next poll reloads again.
        digests = {file: _file_digest(file) for file in _files(self.path, self.config)}
        fingerprint = _combined(list(digests.values()))
        try:
            config, applied = _load_fingerprinted(self.path, digests)
            context = None if config.tls is None else build_context(config.tls)
            if (context is None) != (self.tls is None):
                raise WebConfigError(
                    "tls_server_config",
                    "switching between HTTP and HTTPS needs a restart of the exporter",
                )
        except WebConfigError as exc:
            self._failed = fingerprint  # logged once, not at every poll
            log.error("web config %s not reloaded, the previous one stays: %s", self.path, exc)
            return False
        self.config = config
        self.header_items = _header_items(config)
        if context is not None and self.tls is not None:
            self.tls.swap(context)
        self._fingerprint = applied
        self._failed = None
        self.reloads += 1
        log.info(
            "web config %s reloaded (%s, %d basic-auth user(s))",
            self.path,
            "TLS" if context is not None else "no TLS",
            len(config.users),
        )
        return True


def _header_items(config: WebConfig) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode(), value.encode()) for name, value in config.headers.items()]


async def watch(security: WebSecurity, poll_s: float = POLL_INTERVAL_S) -> None:
    """Reload ``security`` when its files change or on SIGHUP; runs until cancelled.

    The SIGHUP handler is installed only on the main thread (where signals arrive) and
    removed when the task ends; without it SIGHUP would kill the process.
    """
    loop = asyncio.get_running_loop()
    hangup = asyncio.Event()
    previous: Any = None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
        previous = signal.signal(signal.SIGHUP, lambda *_: loop.call_soon_threadsafe(hangup.set))
    try:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(hangup.wait(), poll_s)
            if hangup.is_set():
                hangup.clear()
                log.info("SIGHUP: re-reading web config %s", security.path)
                await asyncio.to_thread(security.reload)
            elif await asyncio.to_thread(security.changed):
                await asyncio.to_thread(security.reload)
    finally:
        if previous is not None:
            signal.signal(signal.SIGHUP, previous)


class SecurityMiddleware:
    """ASGI middleware: the web config's headers on every response, basic auth on reads."""

    def __init__(self, app: ASGIApp, security: WebSecurity) -> None:
        self.app = app
        self.security = security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        security = self.security
        extra = security.header_items
        names = {name for name, _ in extra}

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and extra:
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message["headers"] = kept + extra
            await send(message)

        users = security.config.users
        path = scope["path"]
        if users and path not in OPEN_PATHS and path not in TOKEN_PATHS:
            credentials = parse_basic(_header(scope, b"authorization"))
            if credentials is None or not await security.verifier.verify(users, *credentials):
                await _unauthorized(send_with_headers, credentials is None)
                return
        await self.app(scope, receive, send_with_headers)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _unauthorized(send: Send, missing: bool) -> None:
    detail = (
        "reads need HTTP basic auth with a user of the exporter's web config (basic_auth_users)"
        if missing
        else "wrong user or password (basic_auth_users of the exporter's web config)"
    )
    body = ErrorBody(error="unauthorized", detail=detail).model_dump_json(exclude_none=True)
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", BASIC_CHALLENGE.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})
