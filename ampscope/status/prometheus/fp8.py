"""The FP8 verdicts of ``ampscope status --prometheus``, from the FP8 gauges' scraped samples.

Prometheus holds, per rank, the ``fp8_max_layers`` layers each exporter exports (those with
a live FP8 verdict first), as the gauges of the rank's newest observed iteration, sampled
at each scrape: not every observation, and no step. So:

* ``fp8_nonfinite_amax`` (critical): ``ampscope_fp8_nonfinite_amax_total`` (each exporter's
  count of non-finite amaxes on iterations its rank did not skip: a skipped overflow
  iteration is no FP8 fault) counted within ``WINDOW_S``, as the alert
  ``AmpscopeFp8NonfiniteAmax`` asks; not the gauge's NaN, which VictoriaMetrics drops;
* ``fp8_underflow`` (warning): every ``ampscope_fp8_underflow_ratio`` sample within
  ``WINDOW_S``, at least ``underflow_observations`` of them, above the ratio: scrapes stand
  for the rule's observations;
* ``fp8_amax_spike`` is not evaluated: the spike rule compares an amax with the median of
  the series' previous observations, which only the exporters hold.

The step, and the observations themselves, are in each exporter's health (``FP8_DETAIL``).
The thresholds are ``Fp8Rule``'s defaults: exporters do not publish theirs. Pure functions
but ``queries``; costs O(series).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampscope.status.prometheus.ranks import counted_within
from ampscope.verdicts import fp8 as fp8_rules

WINDOW_S = 600
"""Seconds of samples each FP8 verdict reads: the exporters' verdict window (600 s by
default) and the alerts' 10 minutes."""

FP8_QUERIES = ("fp8_now", "fp8_nonfinite", "fp8_underflow")
"""The names of the FP8 queries in one answer (each series a rank's, plus layer and tensor)."""

FP8_DETAIL = (
    "computed from Prometheus (the FP8 gauges' samples over the last {window:g} s, at most "
    "fp8_max_layers layers a rank): the step and the observations are in each exporter's "
    "GET /api/v1/runs/{run}/health"
)
"""What an FP8 verdict computed from Prometheus says it lacks."""

SPIKE_NEEDS = (
    "each FP8 series' previous observations (the spike rule's median), which only the "
    "exporters hold; the gauges show the newest observation at each scrape"
)
"""Why ``fp8_amax_spike`` is not evaluated from Prometheus."""

_RANK = "run, node, rank, local_rank"


def queries(selector: str, rule: fp8_rules.Fp8Rule) -> dict[str, str]:
    """The FP8 PromQL of one answer (``selector``: the run's label matcher, or empty)."""
    ratio = f"ampscope_fp8_underflow_ratio{{{selector}}}"
    return {
        "fp8_now": ratio,
        "fp8_nonfinite": counted_within("ampscope_fp8_nonfinite_amax_total", selector, WINDOW_S),
        "fp8_underflow": f"min_over_time({ratio}[{WINDOW_S}s])"
        f" and count_over_time({ratio}[{WINDOW_S}s]) >= {rule.underflow_observations}",
    }


def _series(
    run: str, samples: Sequence[Mapping[str, Any]], nodes: Mapping[int, str]
) -> dict[tuple[int, str, str], float]:
    """(rank, layer, tensor) -> value of ``run``'s samples, for the ranks in ``nodes`` (rank
    -> its node) on that node."""
    out = {}
    for sample in samples:
        labels = sample["metric"]
        if labels.get("run") != run or "layer" not in labels or "tensor" not in labels:
            continue
        rank = int(labels["rank"])
        if nodes.get(rank) == labels["node"]:
            out[(rank, labels["layer"], labels["tensor"])] = float(sample["value"][1])
    return out


def _who(nodes: Mapping[int, str], key: tuple[int, str, str]) -> dict[str, Any]:
    rank, layer, tensor = key
    return {"rank": rank, "node": nodes[rank], "layer": layer, "tensor": tensor}


def verdicts(
    run: str,
    views: Sequence[Mapping[str, Any]],
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    rule: fp8_rules.Fp8Rule,
) -> dict[str, dict[str, Any]]:
    """Rule -> the verdict dict of each FP8 rule for ``run``; empty when Prometheus holds no
    FP8 series of its ranks (a run without FP8 layers has no FP8 verdicts)."""
    nodes = {view["rank"]: view["node"] for view in views}
    now = _series(run, results["fp8_now"], nodes)
    if not now:
        return {}
    nonfinite = sorted(_series(run, results["fp8_nonfinite"], nodes))
    lowest = _series(run, results["fp8_underflow"], nodes)
    hits = sorted(
        (key for key, low in lowest.items() if low > rule.underflow_ratio and key in now),
        key=lambda key: (-now[key], key),
    )
    detail = FP8_DETAIL.format(window=WINDOW_S, run=run)
    underflow = fp8_rules.underflow_verdict(
        [{**_who(nodes, key), "step": None, "ratio": now[key]} for key in hits],
        len(hits),
        len(now),
        max(now.values()),
        fp8_rules.underflow_thresholds(rule),
    ).model_dump()
    amax = fp8_rules.nonfinite_verdict(
        [{**_who(nodes, key), "step": None} for key in nonfinite],
        len(nonfinite),
        len(now),
        {"window_s": WINDOW_S},
    ).model_dump()
    spike = {
        "rule": "fp8_amax_spike",
        "status": "ok",
        "summary": f"not evaluated from Prometheus: it needs {SPIKE_NEEDS}",
        "evidence": {"evaluated": False},
        "thresholds": {},
    }
    out = {"fp8_amax_spike": spike, "fp8_underflow": underflow, "fp8_nonfinite_amax": amax}
    for verdict in (underflow, amax):
        verdict["evidence"]["source"] = "prometheus"
        if verdict["status"] != "ok":
            verdict["summary"] += f" ({detail})"
    return out
