"""The one HTTP client of ``ampscope status`` and ``ampscope devices``: every request to an
exporter's JSON API or to a Prometheus-compatible query API goes through ``request_json``,
with the same credentials, TLS, redirects, failures and exit codes.

urllib follows redirects and, by default, copies every header to the next request, the
``Authorization`` header included, whatever host the redirect names. Here the credentials
(basic auth, a bearer token) go as an unredirected header, and a redirect gets them again
only when it stays on the same origin (scheme, host and port): a proxy moving a path keeps
working, and a redirect to another host or port, or from https to http, carries none (the
target then answers 401, which says what is missing). Standard library only.

Failures, each with its exit status (``code``): ``Unreachable`` (3: no answer, or an HTTP
error, ``HttpStatus``), ``Refused`` (5: the credentials, HTTP 401 or 403; 6: TLS), and
``shapes.Malformed`` (7: an answer that is not JSON, or JSON of another shape).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.client import HTTPMessage
from typing import IO, Any
from urllib.parse import urlsplit

from ampscope.reporter.tls import explain_401, explain_tls_failure
from ampscope.status.shapes import Malformed

EXIT_UNREACHABLE = 3
"""No answer, or an HTTP error (of several exporters: none answered)."""
EXIT_UNAUTHORIZED = 5
"""The server refused the credentials (HTTP 401 or 403)."""
EXIT_TLS_REFUSED = 6
"""TLS failed: an untrusted server certificate, a client certificate missing or refused."""
EXIT_MALFORMED = 7
"""An answer of the wrong shape: not JSON, another JSON, a value that is not a number."""

_DEFAULT_PORTS = {"http": 80, "https": 443}


class Unreachable(Exception):
    """The server did not answer, or answered an HTTP error (exit status 3)."""

    code = EXIT_UNREACHABLE


class HttpStatus(Unreachable):
    """The server answered an HTTP error other than 401/403: ``status``, and the start of
    its body in ``detail``."""

    def __init__(self, reason: str, status: int, detail: str) -> None:
        super().__init__(reason)
        self.status = status
        self.detail = detail


class Refused(Exception):
    """The server refused us: ``code`` is ``EXIT_UNAUTHORIZED`` or ``EXIT_TLS_REFUSED``."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Endpoint:
    """A server and how to talk to it: the same for every request to it."""

    url: str
    """Its base URL, without a trailing ``/``."""
    authorization: str | None = None
    """The ``Authorization`` header (``Basic …``, ``Bearer …``), sent to this origin only."""
    context: ssl.SSLContext | None = None
    """For ``https://``: whom to trust, which client certificate to show."""
    client_cert: bool = False
    """A client certificate is configured (for the words of a TLS refusal)."""


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, the port filled in from the scheme's default."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


class CredentialsStayHome(urllib.request.HTTPRedirectHandler):
    """Follows redirects as urllib does (and 307/308 of a ``POST`` with its body); passes
    ``Authorization`` on only within an origin.

    Compared hop by hop: once a redirect left the origin, the credentials are gone for the
    rest of the chain, even if a later hop comes back.
    """

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        if code in (307, 308) and req.data is not None:
            # RFC 9110: 307 and 308 repeat the request, method and body, at the new place
            # (urllib follows them for GET and HEAD only); a query POSTed to Prometheus
            # behind a proxy that moved it arrives whole.
            new: urllib.request.Request | None = urllib.request.Request(
                newurl,
                data=req.data,
                headers={
                    k: v for k, v in req.headers.items() if k.lower() != "host"
                },  # no credentials
                origin_req_host=req.origin_req_host,
                unverifiable=True,
                method=req.get_method(),
            )
        else:
            new = super().redirect_request(req, fp, code, msg, headers, newurl)
        credentials = req.unredirected_hdrs.get("Authorization")
        stays = new is not None and origin(req.full_url) == origin(new.full_url)
        if new is not None and credentials is not None and stays:
            new.add_unredirected_header("Authorization", credentials)
        return new


def open_url(
    request: urllib.request.Request,
    *,
    timeout: float,
    context: ssl.SSLContext | None = None,
    authorization: str | None = None,
) -> Any:
    """``urlopen(request)`` with ``authorization`` sent to ``request``'s origin only.

    Returns the response (a context manager); raises what ``urlopen`` raises.
    """
    if authorization is not None:
        request.add_unredirected_header("Authorization", authorization)
    opener = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=context), CredentialsStayHome()
    )
    return opener.open(request, timeout=timeout)


def request_json(
    endpoint: Endpoint,
    path: str,
    *,
    form: dict[str, str] | None = None,
    timeout: float,
    what: str = "server",
) -> Any:
    """The JSON answer to ``GET {url}{path}`` (``POST`` of the urlencoded ``form`` if given).

    Args:
        endpoint: The server, its credentials and TLS.
        path: The request's path (and query string), from the root of ``endpoint.url``.
        form: Fields to ``POST`` as ``application/x-www-form-urlencoded``.
        timeout: Seconds for connecting and for each read.
        what: The server's kind in the words of a failure (``exporter``, ``Prometheus``).

    Returns:
        The parsed JSON; its shape is the caller's to check (``shapes.check``).

    Raises:
        Refused: HTTP 401 or 403 (``EXIT_UNAUTHORIZED``), a TLS failure (``EXIT_TLS_REFUSED``).
        HttpStatus: another HTTP error status.
        Unreachable: no answer (refused connection, unknown host, time-out, cut answer).
        Malformed: an answer that is not JSON (``NaN`` and ``Infinity`` are not JSON either).
    """
    url = endpoint.url
    where = url + path
    data = None if form is None else urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(where, data=data, method="GET" if form is None else "POST")
    if form is not None:
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with open_url(
            request, timeout=timeout, context=endpoint.context, authorization=endpoint.authorization
        ) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            # The challenge's words name the exporter's web config; Prometheus' proxies vary.
            explained = exc.code == 401 and what == "exporter"
            why = explain_401(exc.headers.get("WWW-Authenticate")) if explained else ""
            said = f"{url} refused the request (HTTP {exc.code})" + (f": {why}" if why else "")
            raise Refused(said, EXIT_UNAUTHORIZED) from None
        detail = " ".join(exc.read(2048).decode("utf-8", "replace").split())[:300]
        said = f"{where} answered HTTP {exc.code}" + (f": {detail}" if detail else "")
        raise HttpStatus(said, exc.code, detail) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # urlopen wraps errors of connecting in URLError, not those of reading the answer.
        reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if endpoint.context is not None and isinstance(reason, BaseException):
            refusal = explain_tls_failure(reason, fresh=True, client_cert=endpoint.client_cert)
            if refusal is not None:
                raise Refused(f"{url}: {refusal}", EXIT_TLS_REFUSED) from None
        raise Unreachable(f"no {what} answers at {url} ({reason})") from None
    try:
        return json.loads(body, parse_constant=_no_constant)
    except ValueError:
        start = " ".join(body[:40].decode("utf-8", "replace").split())
        raise Malformed(where, f"not JSON (it begins {start!r})") from None


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON does not have.
    raise ValueError(f"{name} is not JSON")
