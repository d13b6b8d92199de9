"""``ampscope devices --prometheus URL``: devices ranked by the number of runs in which they
offended (the origin of inf/NaN gradients, an origin outlier, a transient fault, replicas
that outvoted it), with
DCGM-exporter's errors for each GPU where Prometheus holds them.

Exit status: 0 no device offended in ``--min-runs`` runs (default 2) or more, 1 one did, 3
Prometheus cannot be reached or answered an error or a malformed answer, 5 it refused the
credentials (401/403), 6 TLS failed. Reads the raw series, so it needs no recording rule.
Standard library only, like ``ampscope status``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from ampscope.devices import query, ranking
from ampscope.devices.query import EXIT_TLS_REFUSED, EXIT_UNAUTHORIZED, Prometheus, QueryError
from ampscope.reporter.tls import ClientTls

TOKEN_ENV = "AMPSCOPE_PROMETHEUS_TOKEN"
PASSWORD_ENV = "AMPSCOPE_PASSWORD"
DEFAULT_SINCE = "30d"
DEFAULT_MIN_RUNS = 2


def _since(text: str) -> str:
    if not query.DURATION.match(text):
        raise argparse.ArgumentTypeError(f"not a duration like 30d or 12h: {text!r}")
    return text


def _min_runs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``ampscope devices``' arguments."""
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        required=True,
        help="the Prometheus-compatible query API that scrapes the exporters (Prometheus, "
        "VictoriaMetrics, a Thanos or Mimir query frontend)",
    )
    parser.add_argument(
        "--since",
        type=_since,
        default=DEFAULT_SINCE,
        metavar="DURATION",
        help=f"how far back to look (default {DEFAULT_SINCE}; a PromQL duration: 12h, 7d)",
    )
    parser.add_argument(
        "--min-runs",
        type=_min_runs,
        default=DEFAULT_MIN_RUNS,
        metavar="N",
        help=f"flag a device that offended in at least N runs, exit status 1 (default "
        f"{DEFAULT_MIN_RUNS})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of devices (device, node, runs, offences, last_run, ...)",
    )
    parser.add_argument(
        "--bearer-token-file",
        metavar="PATH",
        default=None,
        help=f"file holding the bearer token (default: ${TOKEN_ENV}; never on the command line)",
    )
    parser.add_argument("--user", default=None, help="basic-auth user instead of a token")
    parser.add_argument(
        "--password-file",
        metavar="PATH",
        default=None,
        help=f"file holding --user's password (default: ${PASSWORD_ENV})",
    )
    parser.add_argument(
        "--ca-file",
        metavar="PATH",
        default=None,
        help="CA of an https Prometheus (default: $AMPSCOPE_CA_FILE, else the system's)",
    )
    parser.add_argument(
        "--cert-file",
        metavar="PATH",
        default=None,
        help="client certificate, where Prometheus requires one (default: $AMPSCOPE_CERT_FILE)",
    )
    parser.add_argument(
        "--key-file", metavar="PATH", default=None, help="its key (default: $AMPSCOPE_KEY_FILE)"
    )
    parser.epilog = (
        "Exit status: 0 no device offended in --min-runs runs or more, 1 one did, 3 "
        "Prometheus cannot be reached or answered an error or a malformed answer, 5 it "
        "refused the credentials, 6 TLS failed."
    )


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise QueryError(f"cannot read {flag} {path}: {exc.strerror}", EXIT_UNAUTHORIZED) from None


def client_from_args(args: argparse.Namespace) -> Prometheus:
    """The client, with a bearer token (``--bearer-token-file``, else the environment) or
    the basic auth of ``--user``, and TLS files for ``https://``. Raises ``QueryError``."""
    authorization = None
    if args.user is not None:
        if args.password_file is not None:
            password = _read(args.password_file, "--password-file")
        elif PASSWORD_ENV in os.environ:
            password = os.environ[PASSWORD_ENV]
        else:
            raise QueryError(f"--user needs --password-file or {PASSWORD_ENV}", EXIT_UNAUTHORIZED)
        authorization = "Basic " + base64.b64encode(f"{args.user}:{password}".encode()).decode()
    token = os.environ.get(TOKEN_ENV)
    if args.bearer_token_file is not None:
        token = _read(args.bearer_token_file, "--bearer-token-file")
    if token:
        authorization = f"Bearer {token}"
    context = None
    if args.prometheus.startswith("https://"):
        env = ClientTls.from_env()
        tls = ClientTls(
            ca_file=args.ca_file or env.ca_file,
            cert_file=args.cert_file or env.cert_file,
            key_file=args.key_file or env.key_file,
        )
        try:
            context = tls.context()
        except ValueError as exc:
            raise QueryError(str(exc), EXIT_TLS_REFUSED) from None
    return Prometheus(args.prometheus, authorization, context)


def fetch(client: Prometheus, since: str, min_runs: int) -> list[ranking.Device]:
    """The devices that offended within ``since``, ranked, with their DCGM errors.

    Raises:
        QueryError: a query failed or was answered in another shape than asked.
    """
    now = time.time()
    with ThreadPoolExecutor(max_workers=3) as pool:
        offences = pool.submit(client.query, query.offences_query(since), now)
        last = pool.submit(client.query, query.last_offence_query(since), now)
        dcgm = pool.submit(client.query, query.dcgm_query(), now)
        offence_samples = query.require(
            offences.result(), client.url, ("device", "node", "run", "kind")
        )
        last_samples = query.require(last.result(), client.url, ("device", "node", "run"))
        dcgm_samples = query.require(dcgm.result(), client.url, ("UUID", "field"))
    devices = ranking.rank(offence_samples, last_samples, min_runs)
    ranking.add_dcgm(devices, dcgm_samples)
    return devices


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(seconds))


def _dcgm_text(fields: dict[str, float]) -> str:
    if not fields:
        return "-"
    return ", ".join(
        f"{name.removeprefix('DCGM_FI_DEV_').lower()}={value:g}" for name, value in fields.items()
    )


def table(devices: list[ranking.Device], url: str, since: str, min_runs: int) -> list[str]:
    """The devices as a text table, flagged ones marked ``!``."""
    head = f"devices that offended within {since}, from Prometheus at {url}"
    if not devices:
        return [head, "", "no device offended."]
    kinds = list(dict.fromkeys(k for d in devices for k in d.offences))
    header = ["", "DEVICE", "NODE", "RUNS", *(k.upper() for k in kinds)]
    header += ["LAST RUN", "LAST OFFENCE", "DCGM"]
    rows = [
        [
            "!" if d.flagged else "",
            d.device,
            d.node,
            str(len(d.runs)),
            *(str(d.offences.get(k, 0)) for k in kinds),
            d.last_run or "-",
            _when(d.last_time),
            _dcgm_text(d.dcgm),
        ]
        for d in devices
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [head, ""]
    for cells in (header, *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    flagged = sum(d.flagged for d in devices)
    lines += [
        "",
        f"{flagged} device(s) offended in {min_runs} or more runs (!): drain their nodes and "
        "run the vendor's diagnostics (docs/hardware-triage.md)."
        if flagged
        else f"no device offended in {min_runs} or more runs.",
    ]
    return lines


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the devices once; returns the exit status."""
    out = out or sys.stdout
    try:
        client = client_from_args(args)
        devices = fetch(client, args.since, args.min_runs)
    except QueryError as exc:
        print(f"ampscope devices: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        print(json.dumps([d.as_json() for d in devices]), file=out)
    else:
        print("\n".join(table(devices, client.url, args.since, args.min_runs)), file=out)
    return int(any(d.flagged for d in devices))
