"""``ampscope status --prometheus URL [RUN]``: the whole job read from Prometheus (or
VictoriaMetrics, or a Thanos/Mimir query frontend) through ``/api/v1/query`` only.

Builds the same answer as one exporter's ``--json`` (``ranks`` and ``health`` of a run, or
every run's), with ``null`` where Prometheus does not hold a value (a rank's step time,
last event, restarts, FP8 series: its gauges hold only ``fp8_max_layers`` layers a rank),
and computes the verdicts by the exporter's own rule implementations (``ampscope.verdicts``)
from instant vectors and ``max_over_time`` / ``increase`` over each rule's window;
``scale_desync`` compares the ranks' aligned scales (``ampscope_loss_scale_aligned`` at the
same ``_step``), as the alert rule does. Verdicts
that need the exporter's per-step history (``stalled_rank``'s progress times,
``nonfinite_update_applied``'s first step and origin) say so instead. The spike verdicts
(``loss_spike``, ``grad_norm_spike``, ``origin_outlier``) count ``increase`` of
``ampscope_spikes_total`` over their window: which rank and how many, not the step, value or
baseline, which only the exporters hold (``SPIKE_DETAIL``). Cost: seven instant queries,
run in parallel; the answer holds O(ranks x devices) samples.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ampscope.status import merge, shapes
from ampscope.status.transport import open_url
from ampscope.verdicts import liveness, nonfinite, scale
from ampscope.verdicts import spikes as spike_rules
from ampscope.verdicts.ranks import is_scaler, mode_of
from ampscope.verdicts.rollup import health_report
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import Verdict, in_report_order

GAUGES = (
    "ampscope_rank_info",
    "ampscope_last_step",
    "ampscope_loss_scale",
    "ampscope_growth_tracker",
    "ampscope_loss_scale_aligned",
    "ampscope_loss_scale_aligned_step",
    "ampscope_last_report_timestamp_seconds",
    "ampscope_rank_up",
    "ampscope_rank_state",
    "ampscope_steps_total",
    "ampscope_skipped_steps_total",
    "ampscope_scale_backoffs_total",
    "ampscope_scale_growths_total",
    "ampscope_found_inf_total",
    "ampscope_found_inf_origin_total",
    "ampscope_nonfinite_updates_applied_total",
    "ampscope_reporter_dropped_records_total",
)
"""Families read as instant vectors, in one query by name."""

NEEDS_HISTORY = {
    "stalled_rank": "each rank's time of its last new step, which only the exporters hold; "
    "ampscope_rank_state says which ranks are stalled",
    "nonfinite_update_applied": "the first applied step and its origin, which only the "
    "exporters hold; ampscope_nonfinite_updates_applied_total counts them",
}
"""Rules Prometheus lacks the data for, and what they would need."""

RANK_QUERIES = ("now", "peak", "steps", "skipped", "inf_local", "inf_origin", "spikes")
"""The queries whose every series is a rank's (run, rank and node labels), checked so."""

SPIKE_DETAIL = (
    "counted from Prometheus (increase of ampscope_spikes_total): the step, the value and the "
    "baseline are in each exporter's GET /api/v1/runs/{run}/health"
)
"""What a spike verdict computed from Prometheus says it lacks."""


class QueryError(Exception):
    """Prometheus did not answer, or answered with an error: ``code`` is the exit status."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


def _selector(run: str | None) -> str:
    # A JSON string is a valid PromQL string literal: quotes and backslashes escaped.
    return "" if run is None else f"run={json.dumps(run)}"


def queries(run: str | None, t: Thresholds) -> dict[str, str]:
    """The PromQL of one answer: name -> query."""
    sel = _selector(run)
    names = "|".join(GAUGES)
    joined = f",{sel}" if sel else ""
    return {
        "now": f'{{__name__=~"{names}"{joined}}}',
        "peak": f"max_over_time(ampscope_loss_scale{{{sel}}}[{t.collapse_window_s:g}s])",
        "steps": f"increase(ampscope_steps_total{{{sel}}}[{t.skip_storm_window_s:g}s])",
        "skipped": f"increase(ampscope_skipped_steps_total{{{sel}}}[{t.skip_storm_window_s:g}s])",
        "inf_local": f"increase(ampscope_found_inf_total{{{sel}}}[{t.hotspot_window_s:g}s])",
        "inf_origin": f"increase(ampscope_found_inf_origin_total{{{sel}}}"
        f"[{t.hotspot_window_s:g}s])",
        "spikes": f"increase(ampscope_spikes_total{{{sel}}}[{t.spike_verdict_window_s:g}s])",
    }


def _key(labels: Mapping[str, str]) -> tuple[str, int]:
    return labels["run"], int(labels["rank"])


def _view(info: Mapping[str, str]) -> dict[str, Any]:
    """A ``RankView`` dict from a rank's ``ampscope_rank_info`` labels; values to follow."""
    dtype = info.get("grad_dtype")
    return {
        "run": info["run"],
        "node": info["node"],
        "rank": int(info["rank"]),
        "local_rank": int(info["local_rank"]),
        "world_size": int(info.get("world_size") or 1),
        "local_world_size": None,
        "job_id": info.get("job_id") or None,
        "step": 0,
        "step_time": None,
        "setup": {
            "mode": info.get("mode", "scaler"),
            "policy": info.get("policy", "skip"),
            "grad_dtype": None if dtype in (None, "unknown") else dtype,
        },
        "scale": 1.0,
        "growth_tracker": 0,
        "last_event": None,
        "last_skipped": None,
        "totals": {
            "steps": 0,
            "skipped_steps": 0,
            "backoffs": 0,
            "growths": 0,
            "found_inf_local": {},
            "found_inf_origin": {},
            "nonfinite_params": [],
            "min_scale": None,
            "max_scale": None,
            "aligned_scale": None,
            "nonfinite_applied": 0,
            "first_nonfinite_applied": None,
        },
        "dropped_records": 0,
        "up": False,
        "state": "lost",
        "last_report_time": 0.0,
        "seconds_since_report": 0.0,
        "restarts": None,
        "fp8": None,
    }


_TOTALS = {
    "ampscope_steps_total": "steps",
    "ampscope_skipped_steps_total": "skipped_steps",
    "ampscope_scale_backoffs_total": "backoffs",
    "ampscope_scale_growths_total": "growths",
    "ampscope_nonfinite_updates_applied_total": "nonfinite_applied",
}


def build_views(samples: list[dict[str, Any]], now: float) -> dict[tuple[str, int], dict]:
    """(run, rank) -> ``RankView`` dict from the ``now`` query's samples. A rank counts once
    its info series is there; when a rank restarted onto another node, the copy with the
    newest report wins (as the exporters' merge does)."""
    views: dict[tuple[str, int], dict[str, Any]] = {}
    newest: dict[tuple[str, int], float] = {}
    for sample in samples:
        labels = sample["metric"]
        if labels.get("__name__") == "ampscope_last_report_timestamp_seconds":
            key = _key(labels)
            when = float(sample["value"][1])
            if when >= newest.get(key, -1.0):
                newest[key] = when
                views.setdefault(key, {})["node"] = labels["node"]
    for sample in samples:
        labels = sample["metric"]
        if labels.get("__name__") == "ampscope_rank_info":
            key = _key(labels)
            if views.get(key, {}).get("node", labels["node"]) == labels["node"]:
                views[key] = _view(labels)
    views = {key: view for key, view in views.items() if "rank" in view}
    for sample in samples:
        labels, value = sample["metric"], float(sample["value"][1])
        key = _key(labels)
        view = views.get(key)
        if view is None or labels["node"] != view["node"]:
            continue
        name, totals = labels["__name__"], view["totals"]
        if name == "ampscope_last_step":
            view["step"] = int(value)
        elif name == "ampscope_loss_scale":
            view["scale"] = value
        elif name == "ampscope_growth_tracker":
            view["growth_tracker"] = int(value)
        elif name in _TOTALS:
            totals[_TOTALS[name]] = int(value)
        elif name == "ampscope_found_inf_total":
            totals["found_inf_local"][labels["device"]] = int(value)
        elif name == "ampscope_found_inf_origin_total":
            totals["found_inf_origin"][labels["device"]] = int(value)
        elif name == "ampscope_loss_scale_aligned":
            totals["aligned_scale"] = {**(totals["aligned_scale"] or {}), "scale": value}
        elif name == "ampscope_loss_scale_aligned_step":
            totals["aligned_scale"] = {**(totals["aligned_scale"] or {}), "step": int(value)}
        elif name == "ampscope_reporter_dropped_records_total":
            view["dropped_records"] = int(value)
        elif name == "ampscope_rank_up":
            view["up"] = value == 1.0
        elif name == "ampscope_rank_state" and value == 1.0:
            view["state"] = labels["state"]
        elif name == "ampscope_last_report_timestamp_seconds":
            view["last_report_time"] = value
            view["seconds_since_report"] = max(0.0, now - value)
    return views


def _per_rank(samples: list[dict[str, Any]], views: Mapping[tuple[str, int], dict]) -> dict:
    """(run, rank) -> {device, spike kind or "": value} of a windowed query, for the ranks
    held."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for sample in samples:
        labels = sample["metric"]
        key = _key(labels)
        if key in views and views[key]["node"] == labels["node"]:
            device = labels.get("device") or labels.get("kind", "")
            out.setdefault(key, {})[device] = float(sample["value"][1])
    return out


def health_of(
    run: str,
    views: list[dict[str, Any]],
    windows: Mapping[str, Mapping[tuple[str, int], Mapping[str, float]]],
    t: Thresholds,
    now: float,
) -> dict[str, Any]:
    """The run's ``HealthReport`` dict, each verdict by the shared rule implementation."""

    def window(name: str, view: Mapping[str, Any], device: str = "") -> float:
        return windows[name].get((run, view["rank"]), {}).get(device, 0.0)

    facts = merge.facts_of(views)
    scale_facts = [
        scale.ScaleFacts(
            rank=v["rank"],
            node=v["node"],
            scaler=is_scaler(mode_of(v)),
            scale=v["scale"],
            window_peak_scale=max(v["scale"], window("peak", v)),
        )
        for v in views
    ]
    # increase() extrapolates to the window's edges; a window that holds the whole run
    # would count more than the counter ever held, so it is capped at the counter (a
    # restart inside the window then undercounts, as the exporter's restart rule does).
    steps = [
        nonfinite.StepFacts(
            rank=v["rank"],
            node=v["node"],
            steps=round(min(window("steps", v), v["totals"]["steps"])),
            skipped=round(min(window("skipped", v), v["totals"]["skipped_steps"])),
        )
        for v in views
    ]

    def detections(name: str, view: Mapping[str, Any], kind: str) -> dict[str, int]:
        held = view["totals"][kind]
        found = windows[name].get((run, view["rank"]), {})
        return {d: round(min(n, held.get(d, n))) for d, n in found.items()}

    infs = [
        nonfinite.InfFacts(
            rank=v["rank"],
            node=v["node"],
            local=detections("inf_local", v, "found_inf_local"),
            origin=detections("inf_origin", v, "found_inf_origin"),
        )
        for v in views
    ]

    def lacking(rule: str) -> dict[str, Any]:
        return {
            "rule": rule,
            "status": "ok",
            "summary": f"not evaluated from Prometheus: it needs {NEEDS_HISTORY[rule]}",
            "evidence": {"evaluated": False},
            "thresholds": {},
        }

    def spikes(kind: str) -> list[spike_rules.SpikeFacts]:
        # increase() of a counter that rose by n reads n or a little more (extrapolation).
        counted = [(v, round(window("spikes", v, kind))) for v in views]
        return [
            spike_rules.SpikeFacts(rank=v["rank"], node=v["node"], spikes=n)
            for v, n in counted
            if n
        ]

    def counted(verdict: Verdict) -> dict[str, Any]:
        out = verdict.model_dump()
        out["evidence"]["source"] = "prometheus"
        if out["status"] != "ok":
            out["summary"] += f" ({SPIKE_DETAIL.format(run=run)})"
        return out

    by_rule = {
        "scale_collapse": scale.scale_collapse(scale_facts, t).model_dump(),
        "skip_storm": nonfinite.skip_storm(steps, t).model_dump(),
        "scale_desync": scale.scale_desync(merge.aligned_of(views)).model_dump(),
        "lost_rank": liveness.lost_rank(facts, t).model_dump(),
        "missing_rank": liveness.missing_rank(facts, judged=True).model_dump(),
        "stalled_rank": lacking("stalled_rank"),
        "inf_hotspot": nonfinite.inf_hotspot(infs, t).model_dump(),
        "nonfinite_update_applied": lacking("nonfinite_update_applied"),
        "loss_spike": counted(spike_rules.loss_spike(spikes("loss"), t)),
        "grad_norm_spike": counted(spike_rules.grad_norm_spike(spikes("grad_norm"), t)),
        "origin_outlier": counted(spike_rules.origin_outlier(spikes("origin_outlier"), t)),
    }
    verdicts = [by_rule[rule] for rule in in_report_order(by_rule)]
    up = sum(1 for v in views if v["up"])
    return health_report(run, verdicts, [f.state for f in facts], evaluated_at=now, up=up)


class PrometheusClient:
    """``/api/v1/query`` of one Prometheus-compatible server.

    Args:
        url: Its base URL (a Thanos or Mimir frontend: the path before ``/api/v1``).
        authorization: The ``Authorization`` header (``Bearer …`` or ``Basic …``), read from
            a file or the environment by the caller, never from argv.
        context: TLS context for ``https://``.
    """

    def __init__(self, url: str, authorization: str | None = None, context: Any = None) -> None:
        self.url = url.rstrip("/")
        self.authorization = authorization
        self.context = context

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` at ``at``, its shape checked.

        Raises:
            QueryError: no answer, an HTTP error, or an error answer.
            shapes.Malformed: an answer that is not JSON, or not an instant vector's JSON.
        """
        body = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"}).encode()
        where = f"{self.url}/api/v1/query"
        request = urllib.request.Request(where, data=body, method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        try:
            with open_url(
                request, timeout=10.0, context=self.context, authorization=self.authorization
            ) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise QueryError(f"{self.url} refused the query (HTTP {exc.code})", 5) from None
            detail = exc.read(2048).decode("utf-8", "replace")
            raise QueryError(f"{self.url} answered HTTP {exc.code}: {detail}", 3) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise QueryError(f"no Prometheus answers at {self.url} ({reason})", 3) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            start = raw[:40].decode("utf-8", "replace")
            raise shapes.Malformed(where, f"not JSON (it begins {start!r})") from None
        shapes.check(answer, shapes.QUERY_ANSWER, where)
        if answer["status"] != "success":
            raise QueryError(f"{self.url}: {answer.get('error', answer['status'])}", 3)
        shapes.check(answer.get("data"), shapes.VECTOR, where, at="data")
        return list(answer["data"]["result"])


def fetch(client: PrometheusClient, run: str | None, t: Thresholds) -> dict[str, Any]:
    """The answer in ``status --json``'s shape, from one time instant of Prometheus.

    Raises:
        QueryError: a query failed; ``code`` 4 when ``run`` has no ranks there.
    """
    now = time.time()
    asked = queries(run, t)
    with ThreadPoolExecutor(max_workers=len(asked)) as pool:
        futures = {name: pool.submit(client.query, promql, now) for name, promql in asked.items()}
        results = {name: future.result() for name, future in futures.items()}
    for name in RANK_QUERIES:
        # The labels every rank's series carries: a series without them is not ampscope's.
        where = f"{client.url}/api/v1/query ({name!r} query)"
        shapes.check_series(results.get(name, []), where)
    views = build_views(results["now"], now)
    windows = {name: _per_rank(results[name], views) for name in asked if name != "now"}
    by_run: dict[str, list[dict[str, Any]]] = {}
    for (name, _), view in sorted(views.items()):
        by_run.setdefault(name, []).append(view)
    if run is not None:
        if run not in by_run:
            raise QueryError(f"{client.url} holds no rank of run {run!r}", 4)
        ranks = by_run[run]
        return {
            "url": client.url,
            "run": run,
            "ranks": ranks,
            "health": health_of(run, ranks, windows, t, now),
            "missing_ranks": merge.missing_of(ranks, judged=True),
        }
    health = {name: health_of(name, ranks, windows, t, now) for name, ranks in by_run.items()}
    summaries = [
        {
            "run": name,
            "ranks": len(ranks),
            "up": sum(1 for v in ranks if v["up"]),
            "stale": sum(1 for v in ranks if not v["up"]),
            "states": health[name]["states"],
            "world_size": max(ranks, key=lambda v: v["last_report_time"])["world_size"],
            "newest_step": max(v["step"] for v in ranks),
            "last_report_time": max(v["last_report_time"] for v in ranks),
        }
        for name, ranks in sorted(by_run.items())
    ]
    missing = {name: merge.missing_of(ranks, judged=True) for name, ranks in by_run.items()}
    return {
        "url": client.url,
        "runs": summaries,
        "ranks": by_run,
        "health": health,
        "missing_ranks": missing,
    }
