"""Server TLS from a ``TlsServerConfig``: one ``ssl.SSLContext`` per parse, swappable live.

The listening socket keeps the ``RotatingContext`` it was created with; each new connection
is wrapped by whichever context was swapped in last, the way the exporter-toolkit's
``GetConfigForClient`` re-reads its files per connection. Connections already open keep the
context they started with.
"""

from __future__ import annotations

import ipaddress
import ssl
from typing import Any

from ampscope.exporter.security.webconfig import (
    CURVES,
    TLS12_CIPHERS,
    TlsServerConfig,
    WebConfigError,
)

_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_VERIFY = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


class ServerContext(ssl.SSLContext):
    """A server ``SSLContext`` that remembers the SANs a client certificate must carry."""

    allowed_sans: frozenset[str] = frozenset()


class RotatingContext(ssl.SSLContext):
    """What the server listens with: wraps each new connection in the current context.

    A subclass rather than a proxy object, so that event loops checking for an
    ``SSLContext`` (uvloop) accept it; its own settings are never used.
    """

    current: ServerContext

    def __new__(cls, current: ServerContext) -> RotatingContext:
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)

    def __init__(self, current: ServerContext) -> None:
        self.current = current

    def swap(self, context: ServerContext) -> None:
        """Use ``context`` for connections accepted from now on (atomic: one assignment)."""
        self.current = context

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        return self.current.wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current.wrap_socket(*args, **kwargs)


def build_context(config: TlsServerConfig) -> ServerContext:
    """A server context honouring every key of ``config``; reads the certificate files.

    Raises:
        WebConfigError: a file cannot be read or does not hold what it should, or this
            Python's OpenSSL lacks a cipher suite or curve the file names.
    """
    where = "tls_server_config"
    context = ServerContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[config.min_version]
    context.maximum_version = _VERSIONS[config.max_version]
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(
            f"{where}.cert_file",
            f"cannot load the certificate {config.cert_file} with the key {config.key_file}: "
            f"{_reason(exc)}",
        ) from None
    context.verify_mode = _VERIFY[config.client_auth_type]
    if config.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"{where}.client_ca_file", f"cannot load {config.client_ca_file}: {_reason(exc)}"
            ) from None
    if config.client_ca is not None:
        try:
            context.load_verify_locations(cadata=config.client_ca)
        except (ssl.SSLError, ValueError) as exc:
            raise WebConfigError(f"{where}.client_ca", f"not PEM certificates: {exc}") from None
    context.allowed_sans = frozenset(_normalised(san) for san in config.client_allowed_sans)
    if config.cipher_suites:
        _set_ciphers(context, config.cipher_suites)
    if config.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if config.curve is not None:
        try:
            context.set_ecdh_curve(CURVES[config.curve])
        except (ValueError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"{where}.curve_preferences",
                f"{config.curve} is not available in this Python's OpenSSL: {exc}",
            ) from None
    # HTTP/1.1 only (uvicorn); saying so spares clients an h2 attempt.
    context.set_alpn_protocols(["http/1.1"])
    return context


def _set_ciphers(context: ssl.SSLContext, names: tuple[str, ...]) -> None:
    openssl = [TLS12_CIPHERS[name] for name in names]
    try:
        context.set_ciphers(":".join(openssl))
    except ssl.SSLError:
        available: set[str] = set()
    else:
        available = {c["name"] for c in context.get_ciphers()}
    for name, openssl_name in zip(names, openssl, strict=True):
        if openssl_name not in available:
            raise WebConfigError(
                "tls_server_config.cipher_suites",
                f"{name} ({openssl_name}) is not available in this Python's OpenSSL",
            )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.reason.lower().replace('_', ' ')} ({exc.library})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _normalised(san: str) -> str:
    """IP addresses in one spelling (Go prints them compressed, Python does not)."""
    try:
        return str(ipaddress.ip_address(san.strip()))
    except ValueError:
        return san


def peer_san_refused(ssl_object: ssl.SSLObject | None) -> str | None:
    """Why a connection's client certificate lacks every allowed SAN, or ``None`` when it
    carries one (or no SAN list is configured). Called once per TLS connection, after the
    handshake: the certificate has been verified by then."""
    if ssl_object is None:
        return None
    context = ssl_object.context
    allowed: frozenset[str] = getattr(context, "allowed_sans", frozenset())
    if not allowed:
        return None
    certificate = ssl_object.getpeercert() or {}
    entries: Any = certificate.get("subjectAltName", ())
    names = [_normalised(str(entry[1])) for entry in entries]
    if any(name in allowed for name in names):
        return None
    return f"client certificate SANs {names} match none of client_allowed_sans"
