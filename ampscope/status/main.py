"""``ampscope status [RUN]``: the node's runs (or one run's ranks) and their health.

Reads the exporter's JSON API with the standard library only, so it works wherever
ampscope is installed, without the server extras. Exit status: 0 ok, 1 warning, 2
critical (the worst verdict of the runs shown), 3 when the exporter cannot be reached,
4 when it holds no such run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO

from ampscope.reporter.schema import DEFAULT_URL

EXIT_UNREACHABLE = 3
EXIT_NO_SUCH_RUN = 4


class Unreachable(Exception):
    """The exporter did not answer, or did not answer with the API's JSON."""


class NoSuchRun(Exception):
    """The exporter answered 404 for the run."""


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
        default=None,
        help=f"the exporter (default: $AMPSCOPE_URL, else {DEFAULT_URL})",
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
    parser.epilog = (
        "Exit status: 0 ok, 1 warning, 2 critical (the worst health verdict shown), "
        "3 the exporter cannot be reached, 4 it holds no such run."
    )


def base_url(given: str | None) -> str:
    """``--url``, else ``AMPSCOPE_URL`` (where the ranks report), else the default address."""
    return (given or os.environ.get("AMPSCOPE_URL") or DEFAULT_URL).rstrip("/")


def _get(url: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(url + path, timeout=5.0) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and path.startswith("/api/v1/runs/"):
            raise NoSuchRun(path) from exc
        raise Unreachable(f"{url}{path} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"no exporter answers at {url} ({reason})") from exc


def fetch(url: str, run: str | None) -> dict[str, Any]:
    """The API's answers the view needs: a run's ranks and health, or every run's.

    Raises:
        Unreachable: the exporter did not answer.
        NoSuchRun: ``run`` is not held. A listed run that retention drops between the list
            and its own requests is left out of the table instead.
    """
    if run is not None:
        path = "/api/v1/runs/" + urllib.parse.quote(run, safe="")
        return {"url": url, "run": run, "ranks": _get(url, path + "/ranks"),
                "health": _get(url, path + "/health")}  # fmt: skip
    summaries = _get(url, "/api/v1/runs")
    ranks: dict[str, Any] = {}
    health: dict[str, Any] = {}
    held = []
    for summary in summaries:
        path = "/api/v1/runs/" + urllib.parse.quote(summary["run"], safe="")
        try:
            run_ranks, run_health = _get(url, path + "/ranks"), _get(url, path + "/health")
        except NoSuchRun:
            continue
        held.append(summary)
        ranks[summary["run"]], health[summary["run"]] = run_ranks, run_health
    return {"url": url, "runs": held, "ranks": ranks, "health": health}


def exit_status(answer: dict[str, Any]) -> int:
    """0/1/2 for the worst health status in ``answer`` (no runs: 0)."""
    from ampscope.status.render import SEVERITY

    reports = [answer["health"]] if "run" in answer else list(answer["health"].values())
    return max((SEVERITY[report["status"]] for report in reports), default=0)


def _frame(url: str, run: str | None, as_json: bool) -> tuple[str, int]:
    from ampscope.status import render

    try:
        answer = fetch(url, run)
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


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the status once (or until Ctrl-C with ``--watch``); returns the exit status."""
    out = out or sys.stdout
    url = base_url(args.url)
    if not args.watch:
        text, code = _frame(url, args.run, args.json)
        stream = out if code < EXIT_UNREACHABLE else sys.stderr
        print(text, file=stream, flush=True)
        return code
    redraw = out.isatty() and not args.json
    code = 0
    try:
        while True:
            text, code = _frame(url, args.run, args.json)
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
