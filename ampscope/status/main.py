"""``ampscope status [RUN]``: the node's runs (or one run's ranks) and their health; with
several ``--url`` or ``--targets FILE``, the whole job's, merged from every node's exporter
(``ampscope.status.fanout``).

Reads the exporter's JSON API with the standard library only, so it works wherever
ampscope is installed, without the server extras. Every answer's shape is checked before
it is read (``ampscope.status.shapes``). Exit status: 0 ok, 1 warning, 2 critical (the worst
verdict of the runs shown), 3 when the exporter cannot be reached (of several: when none
can), 4 when it holds no such run, 5 when it refuses our credentials (401), 6 when TLS fails
(untrusted server certificate, client certificate missing or refused), 7 when it answers
something of the wrong shape (of several: when none answers usably), 70 when ampscope
itself fails (a bug: one line, the traceback with ``--debug``), 141 when the reader closed
the pipe (``| head -1``: quietly).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO

from ampscope.reporter.schema import DEFAULT_URL
from ampscope.reporter.tls import (
    clear_text_warning,
    credentials_in_clear,
)
from ampscope.status import access, fanout, merge, pipe, prometheus, shapes, suspects
from ampscope.status.access import (
    PASSWORD_ENV,
    TOKEN_ENV,
    Exporter,
    NoSuchRun,
    Refused,
    Unreachable,
    exporters_from_args,
    prometheus_client_from_args,
)
from ampscope.status.fanout import (
    EXIT_MALFORMED,
    EXIT_NO_SUCH_RUN,
    EXIT_UNREACHABLE,
    TargetResult,
)
from ampscope.status.prometheus.api import PrometheusClient, QueryError
from ampscope.status.shapes import Malformed
from ampscope.status.targets import TargetsError
from ampscope.verdicts.verdict import SEVERITY

EXIT_INTERNAL = 70
"""ampscope itself failed (sysexits' EX_SOFTWARE): never a status a verdict gives."""
EXIT_INTERRUPTED = 130
"""Ctrl-C before the first answer (128 + SIGINT, as shells report it)."""


def _interval(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``ampscope status``'s arguments."""
    parser.add_argument("run", nargs="?", metavar="RUN", help="show this run's ranks")
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        help=f"the exporter (default: $AMPSCOPE_URL, else {DEFAULT_URL}); repeat it for "
        "every node's exporter of a job to see the whole job",
    )
    parser.add_argument(
        "--targets",
        metavar="FILE",
        default=None,
        help="the job's exporters from a Prometheus file_sd file (JSON or YAML, "
        "host:port targets), asked in parallel with any --url",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        default=None,
        help="read the whole job from this Prometheus-compatible query API instead of the "
        "exporters (Prometheus, VictoriaMetrics, a Thanos or Mimir query frontend)",
    )
    parser.add_argument(
        "--bearer-token-file",
        metavar="PATH",
        default=None,
        help=f"file holding --prometheus' bearer token (default: ${TOKEN_ENV}; never on the "
        "command line); --user with --password-file gives basic auth instead",
    )
    parser.add_argument(
        "--scheme",
        choices=("http", "https"),
        default="http",
        help="scheme of the --targets file's host:port targets (default http)",
    )
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds")
    parser.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        metavar="SECONDS",
        help="--watch period (default 2)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the API's JSON (one document per redraw)"
    )
    parser.add_argument(
        "--ca-file",
        metavar="PATH",
        default=None,
        help="CA that signed an https exporter's certificate (default: $AMPSCOPE_CA_FILE, "
        "else the system's)",
    )
    parser.add_argument(
        "--cert-file",
        metavar="PATH",
        default=None,
        help="client certificate, when the exporter requires one (default: $AMPSCOPE_CERT_FILE)",
    )
    parser.add_argument(
        "--key-file",
        metavar="PATH",
        default=None,
        help="its private key (default: $AMPSCOPE_KEY_FILE)",
    )
    parser.add_argument("--user", default=None, help="basic-auth user of the exporter's web config")
    parser.add_argument(
        "--password-file",
        metavar="PATH",
        default=None,
        help=f"file holding --user's password (default: ${PASSWORD_ENV}; never on the "
        "command line)",
    )
    parser.add_argument(
        "--suspect-batches",
        action="store_true",
        help="print RUN's flagged steps with the batch ids each rank noted for them, one "
        "JSON object a line (from the exporters; Prometheus holds no ids)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback when ampscope itself fails (exit status 70)",
    )
    parser.epilog = (
        "Exit status: 0 ok, 1 warning, 2 critical (the worst health verdict shown), "
        "3 the exporter cannot be reached (of several: none can), 4 it holds no such run, "
        "5 it refused the "
        "credentials (401), 6 TLS failed (untrusted server certificate, client certificate "
        "missing or refused), 7 it answered something of the wrong shape (of several: none "
        "answered usably), 70 ampscope itself failed (--debug shows the traceback), 141 "
        "the reader closed the pipe (| head)."
    )


def fetch(url: str | Exporter, run: str | None) -> dict[str, Any]:
    """The API's answers the view needs: a run's ranks and health, or every run's.

    Raises:
        Unreachable: the exporter did not answer.
        NoSuchRun: ``run`` is not held. A listed run that retention drops between the list
            and its own requests is left out of the table instead.
        Refused: the exporter refused the credentials or the TLS handshake.
        Malformed: an answer was not JSON, or JSON of another shape than the API's.
    """
    exporter = Exporter(url) if isinstance(url, str) else url
    url = exporter.url
    if run is not None:
        path = "/api/v1/runs/" + urllib.parse.quote(run, safe="")
        return {
            "url": url,
            "run": run,
            "ranks": access.get_json(exporter, path + "/ranks", shapes.RANKS),
            "health": access.get_json(exporter, path + "/health", shapes.HEALTH),
        }
    summaries = access.get_json(exporter, "/api/v1/runs", shapes.RUNS)
    ranks: dict[str, Any] = {}
    health: dict[str, Any] = {}
    held = []
    for summary in summaries:
        path = "/api/v1/runs/" + urllib.parse.quote(summary["run"], safe="")
        try:
            run_ranks = access.get_json(exporter, path + "/ranks", shapes.RANKS)
            run_health = access.get_json(exporter, path + "/health", shapes.HEALTH)
        except NoSuchRun:
            continue
        held.append(summary)
        ranks[summary["run"]], health[summary["run"]] = run_ranks, run_health
    return {"url": url, "runs": held, "ranks": ranks, "health": health}


def exit_status(answer: dict[str, Any]) -> int:
    """0/1/2 for the worst health status in ``answer`` (no runs: 0)."""
    reports = [answer["health"]] if "run" in answer else list(answer["health"].values())
    return max((SEVERITY[report["status"]] for report in reports), default=0)


def with_missing(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` with its top-level ``missing_ranks``, as one exporter can judge them: only
    where the ranks say their node holds the whole job (``ampscope.verdicts.liveness``)."""
    if "run" in answer:
        return {**answer, "missing_ranks": merge.missing_of(answer["ranks"], judged=False)}
    missing = {run: merge.missing_of(views, judged=False) for run, views in answer["ranks"].items()}
    return {**answer, "missing_ranks": missing}


def _frame(exporter: Exporter, run: str | None, as_json: bool) -> tuple[str, int]:
    from ampscope.status import render

    url = exporter.url
    try:
        answer = with_missing(fetch(exporter, run))
    except Refused as exc:
        return f"ampscope status: {exc}.", exc.code
    except Malformed as exc:
        return f"ampscope status: {exc}.", EXIT_MALFORMED
    except Unreachable as exc:
        return (
            f"ampscope status: {exc}.\nStart one on this node with `ampscope serve` (ranks "
            "report to it through AMPSCOPE_URL), or point --url / AMPSCOPE_URL at the "
            "exporter that is running.",
            EXIT_UNREACHABLE,
        )
    except NoSuchRun:
        return (
            f"ampscope status: the exporter at {url} holds no run {run!r} (it never "
            "reported, or retention dropped it); `ampscope status` lists the runs held.",
            EXIT_NO_SUCH_RUN,
        )
    code = exit_status(answer)
    if as_json:
        return json.dumps(answer), code
    if run is not None:
        lines = render.run_table(run, answer["ranks"], answer["health"])
    else:
        lines = render.runs_table(answer["runs"], answer["ranks"], answer["health"])
    return "\n".join(lines), code


def ask(exporter: Exporter, run: str | None) -> TargetResult:
    """One target's answer or why there is none; never raises."""
    try:
        return TargetResult(exporter.url, fetch(exporter, run), "ok")
    except Refused as exc:
        return TargetResult(exporter.url, None, "refused", str(exc), exc.code)
    except Unreachable as exc:
        return TargetResult(exporter.url, None, "unreachable", str(exc), EXIT_UNREACHABLE)
    except Malformed as exc:
        return TargetResult(exporter.url, None, "malformed", str(exc), EXIT_MALFORMED)
    except NoSuchRun:
        why = f"holds no run {run!r}"
        return TargetResult(exporter.url, None, "no_such_run", why, EXIT_NO_SUCH_RUN)


def _job_frame(exporters: list[Exporter], run: str | None, as_json: bool) -> tuple[str, int]:
    from ampscope.status import render

    answer, code = fanout.job_answer(fanout.fetch_each(exporters, run, ask), run)
    if as_json:
        return json.dumps(answer), code
    targets = answer["targets"]
    if code >= EXIT_UNREACHABLE:
        if code == EXIT_NO_SUCH_RUN:
            return (
                f"ampscope status: none of the {len(targets)} exporter(s) holds run {run!r} "
                "(it never reported, or retention dropped it); `ampscope status` with the "
                "same targets lists the runs held.",
                code,
            )
        failed = "\n".join(render.target_lines(targets))
        return f"ampscope status: no exporter answered usably:\n{failed}", code
    if run is not None:
        lines = render.job_table(
            run, answer["ranks"], answer["health"], answer["missing_ranks"], targets
        )
    else:
        lines = render.runs_table(answer["runs"], answer["ranks"], answer["health"])
        failed_lines = render.target_lines(targets)
        if failed_lines:
            lines += ["", render.FAILED_TARGETS, *failed_lines]
    return "\n".join(lines), code


def _prometheus_frame(client: PrometheusClient, run: str | None, as_json: bool) -> tuple[str, int]:
    from ampscope.status import render

    try:
        answer = prometheus.fetch(client, run)
    except QueryError as exc:
        return f"ampscope status: {exc}.", exc.code
    except Malformed as exc:
        return f"ampscope status: {exc}.", EXIT_MALFORMED
    code = exit_status(answer)
    if as_json:
        return json.dumps(answer), code
    if run is not None:
        lines = render.job_table(
            run, answer["ranks"], answer["health"], answer["missing_ranks"], [],
            source=f"from Prometheus at {client.url}",
        )  # fmt: skip
    else:
        lines = render.runs_table(answer["runs"], answer["ranks"], answer["health"])
    return "\n".join(lines), code


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the status once (or until Ctrl-C with ``--watch``); returns the exit status.

    Whatever fails inside ampscope itself ends here as one line and ``EXIT_INTERNAL``,
    never as a status a verdict gives; ``--debug`` adds the traceback. A reader that closes
    the pipe early (``| head -1``) ends it quietly, with ``pipe.EXIT_CLOSED_PIPE``.
    """
    try:
        return _run(args, out or sys.stdout)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return pipe.closed()  # `ampscope status | head -1`: the reader has what it wanted
    except Exception as exc:
        if getattr(args, "debug", False):
            traceback.print_exc(file=sys.stderr)
        hint = "" if getattr(args, "debug", False) else "; --debug prints the traceback"
        print(
            f"ampscope status: internal error, please report it: {type(exc).__name__}: {exc}{hint}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _warn_clear_text(args: argparse.Namespace, exporters: list[Exporter]) -> None:
    """One line when credentials would cross the network unencrypted."""
    if args.prometheus is None:
        urls = [e.url for e in exporters if e.authorization and credentials_in_clear(e.url)]
        what = "basic-auth credentials"
    else:
        urls = [args.prometheus] if credentials_in_clear(args.prometheus) else []
        what = "the Prometheus credentials"
    if urls:
        where = urls[0] + (f" (and {len(urls) - 1} more)" if len(urls) > 1 else "")
        print(f"ampscope status: {clear_text_warning(what, where)}", file=sys.stderr)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    try:
        exporters = exporters_from_args(args)
    except Refused as exc:
        print(f"ampscope status: {exc}", file=sys.stderr)
        return exc.code
    except TargetsError as exc:
        print(f"ampscope status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    whole_job = len(exporters) > 1 or args.targets is not None
    if args.prometheus is not None:
        try:
            client = prometheus_client_from_args(args)
        except Refused as exc:
            print(f"ampscope status: {exc}", file=sys.stderr)
            return exc.code
        if client.authorization is not None:
            _warn_clear_text(args, exporters)
    else:
        _warn_clear_text(args, exporters)

    if getattr(args, "suspect_batches", False):
        if args.prometheus is not None:
            print(suspects.PROMETHEUS_HAS_NO_IDS, file=sys.stderr)
            return suspects.EXIT_NOT_HERE
        return suspects.run(exporters, args.run, out, sys.stderr)

    def frame() -> tuple[str, int]:
        if args.prometheus is not None:
            return _prometheus_frame(client, args.run, args.json)
        if whole_job:
            return _job_frame(exporters, args.run, args.json)
        return _frame(exporters[0], args.run, args.json)

    url = ", ".join(exporter.url for exporter in exporters)
    if not args.watch:
        text, code = frame()
        stream = out if code < EXIT_UNREACHABLE else sys.stderr
        print(text, file=stream, flush=True)
        return code
    redraw = out.isatty() and not args.json
    code = 0
    try:
        while True:
            text, code = frame()
            if redraw:
                # Home and clear, then the frame: redraws in place like `watch` does.
                stamp = time.strftime("%H:%M:%S")
                out.write(f"\x1b[H\x1b[2J{url}  {stamp}  (Ctrl-C stops)\n\n{text}\n")
            else:
                out.write(text + ("\n" if args.json else "\n\n"))
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return code
