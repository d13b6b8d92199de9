"""The ranks of a run as Prometheus holds them, in the JSON API's ``RankView`` shape: those
whose series are there now, and those whose series were there within the last hour
(``LOOKBACK_S``) and are gone (their exporter's scrape fails, ``up == 0``, or their series went
stale), which are ``lost`` unless their last state was final (``finished``, ``failed`` with
its failure, or ``stopped``), as the exporter's own health would call a rank it no longer
hears. Also
the thresholds the exporters publish (``ampscope_exporter_health_threshold``). Pure functions
over query results.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from ampscope.verdicts import aligned
from ampscope.verdicts.ranks import FINAL_STATES, is_scaler
from ampscope.verdicts.thresholds import Thresholds

LOOKBACK_S = 3600
"""How far back a rank whose series are gone is still looked for: the last hour."""

GAUGES = (
    "ampscope_rank_info",
    "ampscope_last_step",
    "ampscope_loss_scale",
    "ampscope_growth_tracker",
    "ampscope_loss_scale_aligned_packed",
    "ampscope_last_report_timestamp_seconds",
    "ampscope_rank_up",
    "ampscope_rank_failure_info",
    "ampscope_rank_pause_start_timestamp_seconds",
    "ampscope_steps_total",
    "ampscope_skipped_steps_total",
    "ampscope_scale_backoffs_total",
    "ampscope_scale_growths_total",
    "ampscope_found_inf_total",
    "ampscope_found_inf_origin_total",
    "ampscope_nonfinite_updates_applied_total",
    "ampscope_reporter_dropped_records_total",
)
"""Families read as instant vectors, in one query by name. A rank's state and, from exporters
that predate ``ampscope_loss_scale_aligned_packed``, its aligned pair come from their own
queries (``state_query``, ``separate_aligned_query``): one series of five for the state
(``running``'s; the others' of the ranks that are not), none of two for the pair where the
packed sample is there (``without_packed``)."""

SEPARATE_ALIGNED = ("ampscope_loss_scale_aligned", "ampscope_loss_scale_aligned_step")
"""The aligned scale and its step as two series: read only where the packed one is absent."""

SEEN = (
    "ampscope_rank_info",
    "ampscope_last_step",
    "ampscope_last_report_timestamp_seconds",
    "ampscope_steps_total",
    "ampscope_skipped_steps_total",
    "ampscope_rank_failure_info",
)
"""Families whose last values within ``LOOKBACK_S`` describe a rank whose series are gone."""


def seen_query(selector: str) -> str:
    """The last value within ``LOOKBACK_S`` of every ``SEEN`` series (and of the final states,
    ``FINAL_STATES``), named as its family. ``last_over_time`` drops the name, so
    ``label_replace`` puts it back, and in a ``family`` label too, which keeps the families
    apart where ``or`` joins them: VictoriaMetrics' ``or`` matches series without their names
    (and ``or on (__name__)`` on no label at all), so it would keep only a rank's first
    family."""
    joined = f",{selector}" if selector else ""
    selectors = [f"{name}{{{selector}}}" for name in SEEN]
    final = "|".join(FINAL_STATES)
    selectors.append(f'ampscope_rank_state{{state=~"{final}"{joined}}}')
    names = [*SEEN, "ampscope_rank_state"]
    return " or ".join(
        f'label_replace(label_replace(last_over_time({sel}[{LOOKBACK_S}s]), "__name__", '
        f'"{name}", "", ""), "family", "{name}", "", "")'
        for sel, name in zip(selectors, names, strict=True)
    )


def state_query(selector: str) -> str:
    """Whether each rank is ``running``: its one ``ampscope_rank_state{state="running"}``
    series (1 or 0), read alone rather than all five. The exporter exports every state, 1 for
    the current one (Prometheus' enum convention), so a rank at 1 here is at 0 in the others,
    and only the ranks at 0 need ``other_state_query``."""
    joined = f",{selector}" if selector else ""
    return f'ampscope_rank_state{{state="running"{joined}}}'


def other_state_query(selector: str) -> str:
    """The current state of the ranks of ``selector`` that are not running: the one series at
    1 of the four others, named as its family (a comparison's answer may drop the name)."""
    joined = f",{selector}" if selector else ""
    return (
        f'label_replace(ampscope_rank_state{{state!="running"{joined}}} == 1, "__name__", '
        '"ampscope_rank_state", "", "")'
    )


def not_running(samples: Iterable[dict[str, Any]]) -> set[tuple[str, int]]:
    """(run, rank) of the ranks whose ``state_query`` sample is not 1."""
    return {_key(s["metric"]) for s in samples if float(s["value"][1]) != 1.0}


def separate_aligned_query(selector: str) -> str:
    """The aligned scale and step as two series, of the ranks without the packed one (an
    exporter that predates it): empty for the others."""
    joined = f",{selector}" if selector else ""
    names = "|".join(SEPARATE_ALIGNED)
    return (
        f'{{__name__=~"{names}"{joined}}} unless on (run, node, rank, local_rank) '
        f"ampscope_loss_scale_aligned_packed{{{selector}}}"
    )


def without_packed(samples: Iterable[dict[str, Any]]) -> set[tuple[str, int]]:
    """(run, rank) of the scalers among the ranks whose info series ``samples`` (the ``now``
    answer) holds and that have no ``ampscope_loss_scale_aligned_packed`` sample with it:
    the only ranks ``separate_aligned_query`` can answer for (a watch has no aligned scale;
    an exporter that predates the packed sample, or a scaler before its first aligned step,
    has none)."""
    info, packed = set(), set()
    for sample in samples:
        labels = sample["metric"]
        name = labels.get("__name__")
        where = (labels["run"], labels["node"], labels["rank"], labels.get("local_rank"))
        if name == "ampscope_rank_info" and is_scaler(labels.get("mode", "scaler")):
            info.add(where)
        elif name == "ampscope_loss_scale_aligned_packed":
            packed.add(where)
    return {(run, int(rank)) for run, _, rank, _ in info - packed}


def counted_within(family: str, selector: str, window_s: float) -> str:
    """How much each series of ``family`` (a counter exposed once non-zero) within
    ``selector`` counted within the last ``window_s``, in the alerts' form
    (``AmpscopeTransientFault``, ``AmpscopeFp8NonfiniteAmax``), so both count alike.

    By what the series had at the window's start. There: its increase. Absent there: its
    value where it had no sample within ``LOOKBACK_S`` before the window (new; ``increase()``
    cannot count a series' first sample), or where its exporter's scrape at the start
    succeeded (``up == 1``: the exporter counted zero, after its or the rank's restart);
    else its growth since its last sample before the window (a count that grew while scrapes
    failed across the start). A failed scrape writes ``up`` 0 and a staleness marker on every
    series of its exporter, so an old fault whose scrape failed at the window's start is not
    counted again 10 minutes after the gap. ``increase()`` counts only series there at the
    start: VictoriaMetrics' counts a series' first sample where none lies within its
    lookback before the window, as after a long gap. The ranges skip staleness markers and
    read only the few ranks that counted (the counter is exposed once non-zero); ``up`` is
    one series per scrape target, not per rank."""
    counter = f"{family}{{{selector}}}"
    before = f"offset {window_s:g}s"
    last = f"last_over_time({counter}[{LOOKBACK_S}s] {before})"
    return (
        f"(increase({counter}[{window_s:g}s]) > 0 and {counter} {before})"
        f" or ({counter} * 1 unless {last})"
        f" or (({counter} * 1 unless {counter} {before})"
        f" and on (job, instance) (up {before} == 1))"
        f" or ({counter} - {last}) > 0"
    )


def grown_within(series: str, window_s: float) -> str:
    """How much each series of ``series`` (a counter selector, exposed from its rank's start:
    steps, skips, found-inf detections, spikes) grew within the last ``window_s``, as the
    alert and recording rules count it (deploy/prometheus/rules, the file's top comment):
    its value now minus its smallest sample in the window, not ``increase()``.

    VictoriaMetrics' ``increase()`` counts a series' first sample from zero where no sample
    lies within 5 minutes before the window and the value is under 10: after a longer gap in
    the scrapes a healthy rank's few old detections, skips or spikes read as new. This form
    counts what the window's samples show on either engine, exactly (no extrapolation): not a
    count that grew while the scrapes failed, nor the growth from the last sample before the
    window to the first in it. After a reset (the rank's restart) it counts from the
    smallest sample. Costs what ``increase()`` does: one pass over the window's samples."""
    return f"({series} - min_over_time({series}[{window_s:g}s]))"


def gone_query(selector: str) -> str:
    """The ranks of the selection held within ``LOOKBACK_S`` whose info series is gone now,
    matched by (run, rank) (a rank that restarted onto another node is there), each its last
    ``ampscope_rank_info`` sample, named so. The one range read over the hour of every rank,
    of one family: ``seen_query`` then reads the other families for these ranks only."""
    info = f"ampscope_rank_info{{{selector}}}"
    return (
        f"label_replace(last_over_time({info}[{LOOKBACK_S}s]) unless on (run, rank) {info}, "
        '"__name__", "ampscope_rank_info", "", "")'
    )


def up_query(selector: str) -> str:
    """The scrapes that fail now (``up == 0``): few, whatever the job's size."""
    return "up == 0"


def _any_of(label: str, values: Iterable[str]) -> str:
    # An anchored regex of exactly these values, as a PromQL string literal (JSON's escapes
    # are PromQL's).
    return f"{label}=~{json.dumps('|'.join(sorted(re.escape(v) for v in set(values))))}"


def narrowed(selector: str, keys: Iterable[tuple[str, int]]) -> str:
    """``selector`` narrowed to the runs and ranks of ``keys`` ((run, rank); a superset when
    several runs are given, which ``gone_ranks`` filters)."""
    keys = list(keys)
    runs = _any_of("run", (run for run, _ in keys))
    ranks = _any_of("rank", (str(rank) for _, rank in keys))
    return ",".join(part for part in (selector, runs, ranks) if part)


def down_seen_query(selector: str, instances: Iterable[str]) -> str:
    """The last ``ampscope_rank_info`` within ``LOOKBACK_S`` of the selection's ranks that
    the exporters ``instances`` (whose scrape fails) held, named so."""
    where = ",".join(part for part in (selector, _any_of("instance", instances)) if part)
    return (
        f"label_replace(last_over_time(ampscope_rank_info{{{where}}}[{LOOKBACK_S}s]), "
        '"__name__", "ampscope_rank_info", "", "")'
    )


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
        "pause": None,  # ampscope_rank_pause_start_timestamp_seconds, where the exporter has it
        "failure": None,
        "stop_signal": None,  # no series holds it: a stopped rank's state says enough
        "last_report_time": 0.0,
        "seconds_since_report": 0.0,
        "restarts": None,
        "fp8": None,
        "replica_checks": None,
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
    # The packed aligned sample wins over the two separate series (exporters before it
    # served only those): a store can pair one's new value with the other's old one.
    packed: set[tuple[str, int]] = set()
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
        elif name == "ampscope_loss_scale_aligned_packed":
            step, scale = aligned.unpack(value)
            totals["aligned_scale"] = {"step": step, "scale": scale}
            packed.add(key)
        elif name == "ampscope_loss_scale_aligned" and key not in packed:
            totals["aligned_scale"] = {**(totals["aligned_scale"] or {}), "scale": value}
        elif name == "ampscope_loss_scale_aligned_step" and key not in packed:
            totals["aligned_scale"] = {**(totals["aligned_scale"] or {}), "step": int(value)}
        elif name == "ampscope_reporter_dropped_records_total":
            view["dropped_records"] = int(value)
        elif name == "ampscope_rank_up":
            view["up"] = value == 1.0
        elif name == "ampscope_rank_state" and value == 1.0:
            view["state"] = labels["state"]
        elif name == "ampscope_rank_failure_info" and value == 1.0:
            origin = labels.get("origin")
            view["failure"] = {
                "kind": labels.get("kind", "exception"),
                "exception": labels.get("exception", "unknown"),
                "message": None,  # only the exporters hold it
                "step": None,  # the rank's last step, below
                "origin_ranks": [view["rank"]]
                if origin == "yes"
                else []
                if origin == "no"
                else None,
                "seen_by": None,
            }
        elif name == "ampscope_rank_pause_start_timestamp_seconds":
            # As the exporter's API says it: the reason, and the seconds since it began.
            view["pause"] = {
                "reason": labels.get("reason", "pause"),
                "seconds": max(0.0, now - value),
            }
        elif name == "ampscope_last_report_timestamp_seconds":
            view["last_report_time"] = value
            view["seconds_since_report"] = max(0.0, now - value)
    for view in views.values():
        if view["failure"] is not None:
            view["failure"]["step"] = view["step"]
    return views


def per_rank(samples: list[dict[str, Any]], views: Mapping[tuple[str, int], dict]) -> dict:
    """(run, rank) -> {device, spike kind, rerun result or "": value} of a windowed query,
    for the ranks held."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for sample in samples:
        labels = sample["metric"]
        key = _key(labels)
        if key in views and views[key]["node"] == labels["node"]:
            device = labels.get("device") or labels.get("kind") or labels.get("result", "")
            out.setdefault(key, {})[device] = float(sample["value"][1])
    return out


def gone_ranks(
    seen: list[dict[str, Any]], views: Mapping[tuple[str, int], dict], now: float
) -> dict[tuple[str, int], dict[str, Any]]:
    """(run, rank) -> ``RankView`` dict of every rank ``seen`` holds within ``LOOKBACK_S`` and
    ``views`` (the ranks there now) does not: ``lost`` (``up`` false), or ``finished`` or
    ``failed`` (with its failure) when its last state was. Its step, counters and last report
    are the last ones Prometheus holds."""
    gone = {key: view for key, view in build_views(seen, now).items() if key not in views}
    for view in gone.values():
        view["up"] = False
        if view["state"] not in FINAL_STATES:
            view["state"] = "lost"
    return gone


def exporters_down(
    up: Iterable[dict[str, Any]], seen: Iterable[dict[str, Any]]
) -> dict[str, list[str]]:
    """Run -> the exporters (``instance``) that held its ranks and whose scrape fails now."""
    down = {s["metric"].get("instance") for s in up if float(s["value"][1]) == 0.0}
    runs: dict[str, set[str]] = {}
    for sample in seen:
        labels = sample["metric"]
        if labels.get("__name__") == "ampscope_rank_info" and labels.get("instance") in down:
            runs.setdefault(labels["run"], set()).add(labels["instance"])
    return {run: sorted(instances) for run, instances in runs.items()}


def thresholds_of(samples: Iterable[dict[str, Any]]) -> tuple[Thresholds, str]:
    """The thresholds the exporters publish (``ampscope_exporter_health_threshold``), each the
    value most of them give (ties: the smaller), and where they came from: ``exporters``, or
    ``defaults`` when none publishes (exporters that predate it) or what they publish does not
    hold together."""
    given: dict[str, Counter[float]] = {}
    for sample in samples:
        name = sample["metric"].get("threshold")
        given.setdefault(name, Counter())[float(sample["value"][1])] += 1
    chosen: dict[str, Any] = {}
    for field in fields(Thresholds):
        counts = given.get(field.name)
        if counts:
            value = min(counts, key=lambda v: (-counts[v], v))
            chosen[field.name] = int(value) if isinstance(field.default, int) else value
    if not chosen:
        return Thresholds(), "defaults"
    try:
        return Thresholds(**chosen), "exporters"
    except (TypeError, ValueError):
        return Thresholds(), "defaults"
