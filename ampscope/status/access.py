"""Where ``ampscope status`` asks (the exporters, or Prometheus) and with which
credentials: the flags, else the ``AMPSCOPE_*`` environment. Passwords and tokens are read
from files or the environment, never from the command line."""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampscope.reporter.schema import DEFAULT_URL
from ampscope.reporter.tls import ClientTls, explain_401, explain_tls_failure
from ampscope.status import shapes
from ampscope.status.prometheus.api import PrometheusClient
from ampscope.status.shapes import Malformed
from ampscope.status.targets import read_targets
from ampscope.status.transport import open_url

EXIT_UNAUTHORIZED = 5
EXIT_TLS_REFUSED = 6
PASSWORD_ENV = "AMPSCOPE_PASSWORD"
TOKEN_ENV = "AMPSCOPE_PROMETHEUS_TOKEN"


class Unreachable(Exception):
    """The exporter did not answer (or answered an HTTP error)."""


class NoSuchRun(Exception):
    """The exporter answered 404 for the run."""


class Refused(Exception):
    """The exporter refused us: ``code`` is ``EXIT_UNAUTHORIZED`` or ``EXIT_TLS_REFUSED``."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Exporter:
    """Where the exporter is and how to talk to it."""

    url: str
    context: ssl.SSLContext | None = None
    """For ``https://``: whom to trust, which client certificate to show."""
    authorization: str | None = None
    """``Basic ...`` when a user is given."""
    client_cert: bool = False


def client_tls(args: argparse.Namespace) -> ClientTls:
    """The TLS files of the flags, else of ``AMPSCOPE_CA_FILE``/``_CERT_FILE``/``_KEY_FILE``."""
    env = ClientTls.from_env()
    return ClientTls(
        ca_file=args.ca_file or env.ca_file,
        cert_file=args.cert_file or env.cert_file,
        key_file=args.key_file or env.key_file,
    )


def base_url(given: str | None) -> str:
    """``--url``, else ``AMPSCOPE_URL`` (where the ranks report), else the default address."""
    return (given or os.environ.get("AMPSCOPE_URL") or DEFAULT_URL).rstrip("/")


def exporters_from_args(args: argparse.Namespace) -> list[Exporter]:
    """The exporters (``--url``s and ``--targets``, else the default) and the credentials
    from the flags, else ``AMPSCOPE_*``; the same credentials and TLS for every one.

    Raises:
        Refused: unreadable TLS files (``EXIT_TLS_REFUSED``), an unreadable password file or
            ``--user`` without a password (``EXIT_UNAUTHORIZED``).
        TargetsError: an unreadable or malformed ``--targets`` file.
    """
    urls = [base_url(url) for url in args.url or []]
    if args.targets is not None:
        urls += [u.rstrip("/") for u in read_targets(args.targets, args.scheme) if u not in urls]
    urls = list(dict.fromkeys(urls)) or [base_url(None)]
    tls = client_tls(args)
    try:
        context = tls.context() if any(u.startswith("https://") for u in urls) else None
    except ValueError as exc:
        raise Refused(str(exc), EXIT_TLS_REFUSED) from None
    authorization = None
    if args.user is not None:
        if args.password_file is not None:
            try:
                password = Path(args.password_file).read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                message = f"cannot read --password-file {args.password_file}: {exc.strerror}"
                raise Refused(message, EXIT_UNAUTHORIZED) from None
        elif PASSWORD_ENV in os.environ:
            password = os.environ[PASSWORD_ENV]
        else:
            raise Refused(f"--user needs --password-file or {PASSWORD_ENV}", EXIT_UNAUTHORIZED)
        token = base64.b64encode(f"{args.user}:{password}".encode()).decode()
        authorization = f"Basic {token}"
    client_cert = tls.cert_file is not None
    return [
        Exporter(url, context if url.startswith("https://") else None, authorization, client_cert)
        for url in urls
    ]


def prometheus_client_from_args(args: argparse.Namespace, exporter: Exporter) -> PrometheusClient:
    """The ``--prometheus`` client: a bearer token from ``--bearer-token-file`` or
    ``AMPSCOPE_PROMETHEUS_TOKEN``, else the basic auth of ``--user``; TLS as for exporters.

    Raises:
        Refused: an unreadable token file (``EXIT_UNAUTHORIZED``), unreadable TLS files.
    """
    url = args.prometheus.rstrip("/")
    authorization = exporter.authorization
    token = os.environ.get(TOKEN_ENV)
    if args.bearer_token_file is not None:
        try:
            token = Path(args.bearer_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            message = f"cannot read --bearer-token-file {args.bearer_token_file}: {exc.strerror}"
            raise Refused(message, EXIT_UNAUTHORIZED) from None
    if token:
        authorization = f"Bearer {token}"
    context = None
    if url.startswith("https://"):
        try:
            context = client_tls(args).context()
        except ValueError as exc:
            raise Refused(str(exc), EXIT_TLS_REFUSED) from None
    return PrometheusClient(url, authorization, context)


def get_json(exporter: Exporter, path: str, shape: shapes.Check) -> Any:
    """The JSON answer to ``GET {url}{path}``, checked to have ``shape``.

    Raises:
        Unreachable: the exporter did not answer, or answered an HTTP error.
        NoSuchRun: it answered 404 for a run's path.
        Refused: it refused the credentials or the TLS handshake.
        Malformed: the answer is not JSON, or not of ``shape``.
    """
    url = exporter.url
    request = urllib.request.Request(url + path)
    try:
        with open_url(
            request,
            timeout=5.0,
            context=exporter.context,
            authorization=exporter.authorization,
        ) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and path.startswith("/api/v1/runs/"):
            raise NoSuchRun(path) from exc
        if exc.code == 401:
            why = explain_401(exc.headers.get("WWW-Authenticate"))
            message = f"{url} refused the request (HTTP 401): {why}"
            raise Refused(message, EXIT_UNAUTHORIZED) from None
        raise Unreachable(f"{url}{path} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # urlopen wraps errors of connecting in URLError, not those of reading the answer.
        reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if exporter.context is not None and isinstance(reason, BaseException):
            refusal = explain_tls_failure(reason, fresh=True, client_cert=exporter.client_cert)
            if refusal is not None:
                raise Refused(f"{url}: {refusal}", EXIT_TLS_REFUSED) from exc
        raise Unreachable(f"no exporter answers at {url} ({reason})") from exc
    try:
        document = json.loads(body)
    except ValueError:
        start = body[:40].decode("utf-8", "replace")
        raise Malformed(url + path, f"not JSON (it begins {start!r})") from None
    return shapes.check(document, shape, url + path)
