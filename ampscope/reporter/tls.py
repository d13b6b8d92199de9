"""The client side of the exporter's web config: trust, client certificate, token, and
refusals put into words.

Shared by the rank's reporter and ``ampscope status``. Standard library only.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "AMPSCOPE_TOKEN"
"""Bearer token sent with every batch when set."""
TOKEN_FILE_ENV = "AMPSCOPE_TOKEN_FILE"
"""File holding the token (a mounted Secret); wins over ``AMPSCOPE_TOKEN``."""
CA_FILE_ENV = "AMPSCOPE_CA_FILE"
"""PEM CA(s) that signed the exporter's certificate; unset: the system's trust store."""
CERT_FILE_ENV = "AMPSCOPE_CERT_FILE"
"""PEM client certificate shown when the exporter asks for one."""
KEY_FILE_ENV = "AMPSCOPE_KEY_FILE"
"""Its private key (unset: the key is in ``AMPSCOPE_CERT_FILE``)."""

# OpenSSL's reasons for an alert from a server that refused the client's certificate.
_REFUSED_CERT_ALERTS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    }
)
_DROPPED = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
)


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    """How to reach an ``https://`` exporter: whom to trust and what to show."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_env(cls) -> ClientTls:
        """``AMPSCOPE_CA_FILE``, ``AMPSCOPE_CERT_FILE`` and ``AMPSCOPE_KEY_FILE``."""
        return cls(
            ca_file=os.environ.get(CA_FILE_ENV) or None,
            cert_file=os.environ.get(CERT_FILE_ENV) or None,
            key_file=os.environ.get(KEY_FILE_ENV) or None,
        )

    def context(self) -> ssl.SSLContext:
        """A client context verifying the server against ``ca_file`` (or the system store),
        with the client certificate loaded when one is given. Reads the files.

        Raises:
            ValueError: a file cannot be read or holds no certificate or key.
        """
        if self.key_file and not self.cert_file:
            raise ValueError(f"{KEY_FILE_ENV} is set without {CERT_FILE_ENV}")
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the CA file {self.ca_file}: {exc}") from None
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"cannot load the client certificate {self.cert_file} "
                    f"(key {self.key_file or 'in the same file'}): {exc}"
                ) from None
        return context


def token_from_env() -> str | None:
    """The bearer token: ``AMPSCOPE_TOKEN_FILE``'s content, else ``AMPSCOPE_TOKEN``.

    Raises:
        ValueError: ``AMPSCOPE_TOKEN_FILE`` names a file that cannot be read or is empty.
    """
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read {TOKEN_FILE_ENV}={path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"{TOKEN_FILE_ENV}={path} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def explain_tls_failure(exc: BaseException, *, fresh: bool, client_cert: bool) -> str | None:
    """Why a TLS connection failed, in words an operator can act on; ``None`` when
    ``exc`` is not a TLS refusal.

    Args:
        exc: What connecting, sending or reading raised.
        fresh: The connection was opened for this request (a reused one being closed is
            the server ending keep-alive, not a refusal).
        client_cert: A client certificate was configured.
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"untrusted server certificate ({exc.verify_message}): set {CA_FILE_ENV} "
            "(--ca-file) to the CA that signed the exporter's certificate"
        )
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    if reason in _REFUSED_CERT_ALERTS or (fresh and isinstance(exc, _DROPPED)):
        # Under TLS 1.3 the server checks the client's certificate after the client
        # considers the handshake done: a refusal arrives as an alert or a dropped
        # connection on the first request.
        if not client_cert:
            return (
                "the exporter requires a client certificate and none was given: set "
                f"{CERT_FILE_ENV} and {KEY_FILE_ENV} (--cert-file/--key-file)"
            )
        return (
            "the exporter refused our client certificate (not signed by its client_ca_file, "
            "expired, or without an allowed SAN)"
        )
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {reason or exc}"
    return None


def explain_401(challenge: str | None) -> str:
    """A 401's ``WWW-Authenticate`` challenge in words."""
    text = (challenge or "").lower()
    if text.startswith("basic"):
        return "the exporter needs a basic-auth user and password (--user, --password-file)"
    if 'error="invalid_token"' in text:
        return (
            f"wrong token: {TOKEN_ENV} or {TOKEN_FILE_ENV} must hold what the exporter's "
            "--token-file holds"
        )
    return f"no token sent: the exporter requires one; set {TOKEN_ENV} or {TOKEN_FILE_ENV}"


def credentials_in_clear(url: str) -> bool:
    """Whether credentials sent to ``url`` cross a network in clear text: plain ``http://``
    to a host that is not this machine's loopback (``localhost``, 127.0.0.0/8, ``::1``)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: it may resolve anywhere


def clear_text_warning(what: str, url: str) -> str:
    """The one line said when ``what`` (``a bearer token``, ``basic-auth credentials``) goes
    to ``url`` over plain HTTP."""
    return (
        f"warning: {what} sent to {url} over plain http://, readable by anyone on the "
        "network path; use https:// (tls_server_config in the server's web config)"
    )
