"""Where ``ampscope status`` asks (the exporters, or Prometheus) and with which
credentials: the flags, else the ``AMPSCOPE_*`` environment. Passwords and tokens are read
from files or the environment, never from the command line."""

from __future__ import annotations

import argparse
import base64
import os
from pathlib import Path
from typing import Any

from ampscope.reporter.schema import DEFAULT_URL
from ampscope.reporter.tls import ClientTls
from ampscope.status import shapes
from ampscope.status.prometheus.api import PrometheusClient
from ampscope.status.targets import read_targets
from ampscope.status.transport import (
    EXIT_TLS_REFUSED,
    EXIT_UNAUTHORIZED,
    Endpoint,
    HttpStatus,
    Refused,
    Unreachable,
    request_json,
)

__all__ = ["EXIT_TLS_REFUSED", "EXIT_UNAUTHORIZED", "Exporter", "NoSuchRun", "Refused"]
__all__ += ["Unreachable", "exporters_from_args", "get_json", "prometheus_client_from_args"]

PASSWORD_ENV = "AMPSCOPE_PASSWORD"
TOKEN_ENV = "AMPSCOPE_PROMETHEUS_TOKEN"


class NoSuchRun(Exception):
    """The exporter answered 404 for the run."""


Exporter = Endpoint
"""Where an exporter is and how to talk to it (the one client's ``Endpoint``)."""


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
    authorization = basic_authorization(args)
    client_cert = tls.cert_file is not None
    return [
        Exporter(
            url,
            authorization=authorization,
            context=context if url.startswith("https://") else None,
            client_cert=client_cert,
        )
        for url in urls
    ]


def basic_authorization(args: argparse.Namespace) -> str | None:
    """``Basic …`` for ``--user`` with ``--password-file``, else ``AMPSCOPE_PASSWORD``;
    ``None`` without ``--user``.

    Raises:
        Refused: an unreadable password file, or ``--user`` without a password
            (``EXIT_UNAUTHORIZED``).
    """
    if args.user is None:
        return None
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
    return f"Basic {token}"


def prometheus_client_from_args(args: argparse.Namespace) -> PrometheusClient:
    """The ``--prometheus`` client: a bearer token from ``--bearer-token-file`` or
    ``AMPSCOPE_PROMETHEUS_TOKEN``, else the basic auth of ``--user``; TLS as for exporters.

    Raises:
        Refused: an unreadable token file (``EXIT_UNAUTHORIZED``), unreadable TLS files.
    """
    url = args.prometheus.rstrip("/")
    authorization = basic_authorization(args)
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
    tls = client_tls(args)
    if url.startswith("https://"):
        try:
            context = tls.context()
        except ValueError as exc:
            raise Refused(str(exc), EXIT_TLS_REFUSED) from None
    return PrometheusClient(Endpoint(url, authorization, context, tls.cert_file is not None))


def get_json(exporter: Exporter, path: str, shape: shapes.Check) -> Any:
    """The JSON answer to ``GET {url}{path}``, checked to have ``shape``.

    Raises:
        Unreachable: the exporter did not answer, or answered an HTTP error.
        NoSuchRun: it answered 404 for a run's path.
        Refused: it refused the credentials or the TLS handshake.
        Malformed: the answer is not JSON, or not of ``shape``.
    """
    try:
        document = request_json(exporter, path, timeout=5.0, what="exporter")
    except HttpStatus as exc:
        if exc.status == 404 and path.startswith("/api/v1/runs/"):
            raise NoSuchRun(path) from None
        raise
    return shapes.check(document, shape, exporter.url + path)
