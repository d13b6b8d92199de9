"""``ampscope status RUN --suspect-batches``: the batch ids behind a run's flagged steps.

Asks each exporter (one ``--url``, several, or ``--targets``, in parallel) for
``/api/v1/runs/{run}/suspect-batches`` and prints one JSON object per flagged (step, rank),
sorted by step then rank: ``step``, ``rank``, ``reasons``, ``batch_ids`` and
``batch_ids_left_out``, ready to feed a skip list on resume. Each exporter holds the ids of
its own node's ranks, so the lines of several exporters add up. Prometheus holds no ids
(they would be a label per sample): with ``--prometheus`` it says so and asks for the
exporters instead.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence
from typing import Any, TextIO

from ampscope.status import access, fanout, shapes
from ampscope.status.fanout import EXIT_NO_SUCH_RUN, EXIT_UNREACHABLE, TargetResult

EXIT_NOT_HERE = EXIT_UNREACHABLE
"""Prometheus was asked: it cannot answer (the ids live in the exporters)."""

PROMETHEUS_HAS_NO_IDS = (
    "ampscope status: --suspect-batches reads the exporters, not Prometheus: the batch ids "
    "live in each node's exporter (GET /api/v1/runs/RUN/suspect-batches); give them with "
    "--url or --targets"
)


def path_of(run: str) -> str:
    return "/api/v1/runs/" + urllib.parse.quote(run, safe="") + "/suspect-batches"


def merged(results: Sequence[TargetResult]) -> list[dict[str, Any]]:
    """The suspects of every target that answered, sorted by step then rank."""
    rows = [row for r in results if r.answer is not None for row in r.answer["suspects"]]
    return sorted(rows, key=lambda row: (row["step"], row["rank"]))


def exit_code(results: Sequence[TargetResult]) -> int:
    """0 when a target answered; else 4 when each said no such run, else the first
    failure's code."""
    if any(r.answer is not None for r in results):
        return 0
    if results and all(r.status == "no_such_run" for r in results):
        return EXIT_NO_SUCH_RUN
    return next((r.code for r in results if r.code), EXIT_UNREACHABLE)


def run(
    exporters: Sequence[Any],
    run_id: str | None,
    out: TextIO,
    err: TextIO,
) -> int:
    """Print the suspects of ``run_id`` as JSON lines on ``out``, each failing target's
    reason on ``err``; returns the exit status (see ``exit_code``)."""
    if run_id is None:
        print("ampscope status: --suspect-batches needs a RUN", file=err)
        return EXIT_NO_SUCH_RUN
    results = fanout.fetch_each(exporters, run_id, ask)
    for result in results:
        if result.answer is None:
            print(f"ampscope status: {result.url}: {result.error}", file=err)
    for row in merged(results):
        print(json.dumps(row), file=out)
    out.flush()
    return exit_code(results)


def ask(exporter: Any, run_id: str | None) -> TargetResult:
    """One exporter's suspects (``{"suspects": [...]}``, shape checked) or why there are
    none; never raises."""
    url = exporter.url
    assert run_id is not None
    try:
        rows = access.get_json(exporter, path_of(run_id), shapes.SUSPECT_BATCHES)
    except access.Refused as exc:
        return TargetResult(url, None, "refused", str(exc), exc.code)
    except access.Unreachable as exc:
        return TargetResult(url, None, "unreachable", str(exc), EXIT_UNREACHABLE)
    except shapes.Malformed as exc:
        return TargetResult(url, None, "malformed", str(exc), fanout.EXIT_MALFORMED)
    except access.NoSuchRun:
        why = f"holds no run {run_id!r}"
        return TargetResult(url, None, "no_such_run", why, EXIT_NO_SUCH_RUN)
    return TargetResult(url, {"suspects": rows}, "ok")
