"""``ampscope devices --prometheus URL``: devices ranked by the number of runs in which they
offended (the origin of inf/NaN gradients, a transient fault, replicas that outvoted it;
not an origin outlier alone, which older exporters counted: ``ranking.RETIRED_KINDS``), with
DCGM-exporter's errors for each GPU where Prometheus holds them.

Exit status: 0 no device offended in ``--min-runs`` runs (default 2) or more, 1 one did, 3
Prometheus cannot be reached or answered an error, 5 it refused the credentials (401/403),
6 TLS failed, 7 it answered something of the wrong shape (not JSON, a sample without its
labels, a value that is not a finite number), as ``ampscope status`` does: both ask through
one client (``ampscope.status.transport``: credentials that never follow a redirect to
another origin). Reads the raw series, so it needs no recording rule. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

from ampscope.devices import query, ranking
from ampscope.reporter.tls import clear_text_warning, credentials_in_clear
from ampscope.status import pipe
from ampscope.status.access import PASSWORD_ENV, TOKEN_ENV, prometheus_client_from_args
from ampscope.status.prometheus.api import PrometheusClient, QueryError
from ampscope.status.shapes import Malformed
from ampscope.status.transport import EXIT_MALFORMED, Refused

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
        "Prometheus cannot be reached or answered an error, 5 it refused the credentials, "
        "6 TLS failed, 7 it answered something of the wrong shape, 141 the reader closed "
        "the pipe."
    )


def fetch(
    client: PrometheusClient,
    since: str,
    min_runs: int,
    warn: Callable[[str], None] | None = None,
) -> list[ranking.Device]:
    """The devices that offended within ``since``, ranked, with their DCGM errors. Three
    queries in parallel; blocks until all are answered.

    ``warn`` hears of DCGM-exporter series left out (without a UUID label): never a failure.

    Raises:
        QueryError: a query failed.
        Malformed: an answer of another shape than asked, a value that is not finite.
    """
    now = time.time()
    where = f"{client.url}/api/v1/query"
    with ThreadPoolExecutor(max_workers=3) as pool:
        offences = pool.submit(client.query, query.offences_query(since), now)
        last = pool.submit(client.query, query.last_offence_query(since), now)
        dcgm = pool.submit(client.query, query.dcgm_query(), now)
        offence_samples = query.require(
            query.samples_of(offences.result()),
            f"{where} (offences)",
            ("device", "node", "run", "kind"),
        )
        last_samples = query.require(
            query.samples_of(last.result()), f"{where} (last offences)", ("device", "node", "run")
        )
        # DCGM-exporter's series are another program's: a series without a UUID label
        # (neither UUID nor --use-old-namespace's uuid) is left out with a warning.
        dcgm_samples = query.require(query.samples_of(dcgm.result()), f"{where} (DCGM)", ("field",))
    devices = ranking.rank(offence_samples, last_samples, min_runs)
    unnamed = ranking.add_dcgm(devices, dcgm_samples)
    if unnamed and warn is not None:
        first = unnamed[0].labels
        warn(
            f"left out {len(unnamed)} DCGM-exporter series without a UUID or uuid label "
            f"(the first: {first.get('field', '?')} of {first.get('instance', '?')})"
        )
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


def _warn(words: str) -> None:
    print(f"ampscope devices: warning: {words}", file=sys.stderr)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the devices once; returns the exit status. A reader that closes the pipe
    early (``| head``) ends it quietly (``pipe.EXIT_CLOSED_PIPE``)."""
    out = out or sys.stdout
    try:
        client = prometheus_client_from_args(args)
        if client.authorization is not None and credentials_in_clear(client.url):
            print(
                f"ampscope devices: {clear_text_warning('the Prometheus credentials', client.url)}",
                file=sys.stderr,
            )
        devices = fetch(client, args.since, args.min_runs, _warn)
    except (QueryError, Refused) as exc:
        print(f"ampscope devices: {exc}", file=sys.stderr)
        return exc.code
    except Malformed as exc:
        print(f"ampscope devices: {exc}", file=sys.stderr)
        return EXIT_MALFORMED
    try:
        if args.json:
            print(json.dumps([d.as_json() for d in devices]), file=out, flush=True)
        else:
            lines = table(devices, client.url, args.since, args.min_runs)
            print("\n".join(lines), file=out, flush=True)
    except BrokenPipeError:
        return pipe.closed()
    return int(any(d.flagged for d in devices))
