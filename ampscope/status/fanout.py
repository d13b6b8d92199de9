"""``ampscope status --url A --url B …`` / ``--targets FILE``: every exporter of a job asked
in parallel (one thread each, up to ``MAX_PARALLEL``), merged into one whole-job answer.

A target that does not answer, or answers something of the wrong shape, is named in the
answer and does not hide the others. The answer has the keys of one exporter's ``--json``
answer, plus ``missing_ranks`` and ``targets`` (each target's url, ``status`` and error).
Wall time: about the slowest target's, each bounded by the client's 5 s timeout per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ampscope.status import merge
from ampscope.status.transport import EXIT_MALFORMED, EXIT_UNREACHABLE
from ampscope.verdicts.verdict import SEVERITY

MAX_PARALLEL = 32
"""Targets asked at once; more wait for a free thread."""

__all__ = ["EXIT_MALFORMED", "EXIT_NO_SUCH_RUN", "EXIT_UNREACHABLE", "TargetResult"]
EXIT_NO_SUCH_RUN = 4

E = TypeVar("E")


@dataclass(frozen=True)
class TargetResult:
    """What one target answered: ``answer``, or ``status`` and ``error`` saying why not."""

    url: str
    answer: dict[str, Any] | None
    status: str
    """``ok``, ``no_such_run``, ``unreachable``, ``refused`` or ``malformed``."""
    error: str | None = None
    code: int = 0
    """The exit status this failure gives on its own (3, 4, 5, 6 or 7); 0 when ok."""


def fetch_each(
    targets: Sequence[E],
    run: str | None,
    ask: Callable[[E, str | None], TargetResult],
) -> list[TargetResult]:
    """``ask`` every target in parallel; results in the targets' order."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(targets)))) as pool:
        return list(pool.map(lambda target: ask(target, run), targets))


def _target_rows(results: Sequence[TargetResult]) -> list[dict[str, Any]]:
    return [{"url": r.url, "status": r.status, "error": r.error} for r in results]


def job_answer(results: Sequence[TargetResult], run: str | None) -> tuple[dict[str, Any], int]:
    """The merged answer and its exit status: the worst verdict of the targets that answered
    usably; when none did, 3 (or the one failure every target shares: 5 for refused
    credentials, 6 for TLS, 7 for answers of the wrong shape); 4 when ``run`` is given and
    no answering target holds it."""
    answered = [r for r in results if r.answer is not None]
    url = ", ".join(r.url for r in results)
    base: dict[str, Any] = {"url": url, "targets": _target_rows(results)}
    if not answered:
        codes = {r.code for r in results}
        if run is not None and codes == {EXIT_NO_SUCH_RUN}:
            return base, EXIT_NO_SUCH_RUN
        failed = {r.code for r in results if r.code != EXIT_NO_SUCH_RUN}
        return base, failed.pop() if len(failed) == 1 else EXIT_UNREACHABLE
    if run is not None:
        answers = [r.answer for r in answered if r.answer is not None]
        views = merge.merge_ranks([a["ranks"] for a in answers])
        pairs = [(r.url, r.answer["health"]) for r in answered if r.answer is not None]
        health = merge.merge_health(run, pairs, views)
        answer = {
            **base,
            "run": run,
            "ranks": views,
            "health": health,
            "missing_ranks": merge.missing_of(views, judged=True),
        }
        return answer, SEVERITY[health["status"]]
    summaries = merge.merge_summaries([r.answer["runs"] for r in answered if r.answer])
    ranks: dict[str, Any] = {}
    health_by_run: dict[str, Any] = {}
    missing: dict[str, list[int]] = {}
    for summary in summaries:
        name = summary["run"]
        holders = [r for r in answered if r.answer is not None and name in r.answer["health"]]
        views = merge.merge_ranks([r.answer["ranks"][name] for r in holders if r.answer])
        pairs = [(r.url, r.answer["health"][name]) for r in holders if r.answer]
        ranks[name] = views
        health_by_run[name] = merge.merge_health(name, pairs, views)
        missing[name] = merge.missing_of(views, judged=True)
        # Counted again over the merged ranks: a rank two exporters hold counts once.
        summary["ranks"] = len(views)
        summary["up"] = sum(1 for view in views if view.get("up"))
        summary["stale"] = summary["ranks"] - summary["up"]
        summary["states"] = health_by_run[name]["states"]
    answer = {
        **base,
        "runs": summaries,
        "ranks": ranks,
        "health": health_by_run,
        "missing_ranks": missing,
    }
    worst = max((SEVERITY[h["status"]] for h in health_by_run.values()), default=0)
    return answer, worst
