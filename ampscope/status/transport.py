"""HTTP requests of ``ampscope status``, with credentials that stay with their host.

urllib follows redirects and, by default, copies every header to the next request, the
``Authorization`` header included, whatever host the redirect names. Here the credentials
(basic auth, a bearer token) go as an unredirected header, and a redirect gets them again
only when it stays on the same origin (scheme, host and port): a proxy moving a path keeps
working, and a redirect to another host or port, or from https to http, carries none (the
target then answers 401, which says what is missing). Standard library only.
"""

from __future__ import annotations

import ssl
import urllib.request
from http.client import HTTPMessage
from typing import IO, Any
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


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
    """Follows redirects as urllib does; passes ``Authorization`` on only within an origin.

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
