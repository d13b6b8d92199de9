"""``ampscope serve``: run the per-node exporter.

Flags override ``AMPSCOPE_*`` environment variables, which override the defaults of
``ampscope.exporter.settings.Settings``. Only the standard library is imported until
``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import sys

# flag -> (Settings field, type, help). Defaults live in Settings alone; the help text
# states them and a test checks it does so truthfully.
_OPTIONS: dict[str, tuple[str, type, str]] = {
    "--host": ("host", str, "bind address (default 127.0.0.1: loopback only)"),
    "--port": ("port", int, "TCP port (default 9478)"),
    "--token-file": (
        "token_file",
        str,
        "file holding the bearer token ingest requires (default: none, or AMPSCOPE_TOKEN)",
    ),
    "--web-config-file": (
        "web_config_file",
        str,
        "exporter-toolkit web config: TLS, client certificates, basic-auth users, headers "
        "(default: none, plain HTTP and open reads)",
    ),
    "--stale-after": (
        "stale_after_s",
        float,
        "seconds without hearing from a rank (records or heartbeats) before it is lost, "
        "unless it sent its final record (default 60)",
    ),
    "--stall-after": (
        "stall_after_s",
        float,
        "seconds a rank still heard from may go without a new step before it is stalled "
        "(default 600)",
    ),
    "--pause-limit": (
        "pause_limit_s",
        float,
        "the same for a rank whose heartbeats say it paused on purpose (a checkpoint save, "
        "an evaluation: paused()); the larger of the two applies (default 7200)",
    ),
    "--finished-retention": (
        "finished_retention_s",
        float,
        "seconds a finished rank's series are kept after its final record (default 3600)",
    ),
    "--retention": (
        "retention_s",
        float,
        "seconds without a report before a rank's series are dropped (default 3600)",
    ),
    "--history-length": ("history_length", int, "step records kept per rank (default 1024)"),
    "--max-body-bytes": ("max_body_bytes", int, "largest ingest body (default 8388608)"),
    "--max-runs": ("max_runs", int, "runs held at once (default 64)"),
    "--max-ranks-per-run": ("max_ranks_per_run", int, "ranks per run (default 4096)"),
    "--header-timeout": (
        "header_timeout_s",
        float,
        "seconds a connection has to send its request headers, else 408 (default 10)",
    ),
    "--body-timeout": (
        "body_timeout_s",
        float,
        "seconds a request has to send its whole body, else 408 (default 30)",
    ),
    "--max-connections": (
        "max_connections",
        int,
        "open connections at most; more get 503 at once (default 512)",
    ),
    "--max-inflight-bytes": (
        "max_inflight_bytes",
        int,
        "ingest body bytes received at once over all requests; more get 429 (default 67108864)",
    ),
    "--log-level": ("log_level", str, "critical|error|warning|info|debug (default info)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``ampscope serve``'s flags. Every setting also reads ``AMPSCOPE_<FIELD>``."""
    metavars = {str: "TEXT", int: "N", float: "SECONDS"}
    for flag, (field, type_, help_) in _OPTIONS.items():
        metavar = "PATH" if field in ("token_file", "web_config_file") else metavars[type_]
        parser.add_argument(flag, dest=field, type=type_, default=None, metavar=metavar, help=help_)
    parser.add_argument(
        "--access-log",
        dest="access_log",
        action="store_true",
        default=None,
        help="log every request (default off)",
    )
    parser.epilog = (
        "Every setting, including limits and health thresholds without a flag, also reads "
        "AMPSCOPE_<NAME> from the environment, e.g. AMPSCOPE_MAX_SERIES=100000 or "
        "AMPSCOPE_SKIP_STORM_RATIO=0.5; flags win over the environment."
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (the OS error), or ``None`` when it can.

    Binds as uvicorn does (``SO_REUSEADDR``), so a port in TIME_WAIT counts as free; checked
    before start-up so that a busy port costs one line, not a traceback after start-up logs.
    """
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    """Build the settings, then serve until SIGINT/SIGTERM. Returns the exit status."""
    import uvicorn
    from pydantic import ValidationError

    from ampscope.exporter.app import create_app
    from ampscope.exporter.http.server import guarded_protocol
    from ampscope.exporter.security.policy import WebSecurity
    from ampscope.exporter.security.webconfig import WebConfigError
    from ampscope.exporter.settings import Settings

    fields = [field for field, _, _ in _OPTIONS.values()] + ["access_log"]
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            where = ".".join(map(str, error["loc"])) or "settings"
            print(f"ampscope serve: {where}: {error['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("ampscope.exporter")
    security = None
    if settings.web_config_file is not None:
        try:
            security = WebSecurity.from_file(settings.web_config_file)
        except WebConfigError as exc:
            print(f"ampscope serve: {settings.web_config_file}: {exc}", file=sys.stderr)
            return 2
    if security is not None and security.config.tls_ignored:
        log.warning(
            "web config %s: tls_server_config sets %s but none of cert_file, key_file, "
            "client_ca_file, client_auth_type: plain HTTP, as the exporter-toolkit serves it",
            settings.web_config_file,
            ", ".join(security.config.tls_ignored),
        )
    if not _is_loopback(settings.host) and settings.token is None:
        log.warning(
            "listening on %s without a token: anyone who reaches the port can post records "
            "(use --token-file)",
            settings.host,
        )
    busy = _port_in_use(settings.host, settings.port)
    if busy is not None:
        print(
            f"ampscope serve: port {settings.port} on {settings.host} is in use ({busy}); "
            "stop what holds it, or pick another with --port",
            file=sys.stderr,
        )
        return 1
    tls = security.tls if security is not None else None
    users = len(security.config.users) if security is not None else 0
    if not _is_loopback(settings.host) and tls is None and (users or settings.token):
        log.warning(
            "listening on %s without TLS: the token and passwords cross the network in "
            "clear text (tls_server_config in --web-config-file)",
            settings.host,
        )
    log.info(
        "ampscope exporter on %s://%s:%d (ingest %s; reads %s)",
        "https" if tls is not None else "http",
        settings.host,
        settings.port,
        "needs a bearer token" if settings.token else "open",
        f"need basic auth ({users} user(s))" if users else "open",
    )
    _raise_open_file_limit(settings.max_connections, log)
    app = create_app(settings, security=security)
    _tune_gc()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        # The listener keeps this context; it hands each new connection to the context
        # built from the web config in force (ampscope.exporter.security.tls.RotatingContext).
        ssl_context_factory=None if tls is None else (lambda config, default: tls),
        # uvicorn's httptools protocol with header/body timeouts and a connection cap.
        http=guarded_protocol(settings, app.state.stats, security),
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_keep_alive=settings.keep_alive_timeout_s,
    )
    return 0


GC_GEN0_THRESHOLD = 50_000
"""Allocations between young collections (CPython's default: 700)."""


def _tune_gc() -> None:
    """Fewer full garbage collections while batches are parsed.

    A 7 MiB batch allocates ~10^5 objects, which with CPython's default thresholds sets
    off full collections that traverse every record the store holds, holding the GIL for
    100-400 ms each (the largest stall of /healthz during ingest). Records are freed by
    reference counting, not by the cycle collector, so collecting young objects less
    often costs little memory; everything imported so far is frozen out of the scans.
    """
    import gc

    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _raise_open_file_limit(max_connections: int, log: logging.Logger) -> None:
    """Raise the soft open-file limit to the hard one (as Go programs do at start), so
    ``max_connections`` is reached before the process runs out of descriptors."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    # Descriptors beyond connections: the listening socket, logs, imports.
    if soft != resource.RLIM_INFINITY and soft < max_connections + 64:
        log.warning(
            "open-file limit %d is close to max_connections=%d: new connections may fail "
            "before the cap answers 503 (raise ulimit -n or lower --max-connections)",
            soft,
            max_connections,
        )
