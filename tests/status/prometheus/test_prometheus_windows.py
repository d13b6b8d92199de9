"""``ampscope status --prometheus`` counts reruns within the verdicts' window, as the exporter
and the alerts do, and reads a rank's aligned step and scale from one sample."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support import promtool_test_queries

from ampscope.status import prometheus
from ampscope.status.prometheus.ranks import build_views
from ampscope.verdicts.aligned import pack
from ampscope.verdicts.thresholds import Thresholds

RUN = "rr"
NOW = 1_700_000_000.0


def _labels(rank: int, **more: str) -> str:
    labels = {"run": RUN, "node": "n0", "rank": str(rank), "local_rank": str(rank), **more}
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def test_reruns_are_counted_within_the_verdicts_window_on_promtool(tmp_path: Path) -> None:
    """The query as sent, on Prometheus' own engine: a rerun counts for 600 s from when its
    counter appeared or grew, then no more, though the rank process (and its counter) lives."""
    t = Thresholds()
    assert t.spike_verdict_window_s == 600
    query = prometheus.queries(RUN, t)["reruns"]
    counter = "ampscope_reruns_total"
    series = [
        # rank 0: a transient result at 45s; rank 1: a reproduced one at 0s (its counter
        # there from the start) and another at 12m.
        {"series": f"{counter}{{{_labels(0, result='transient')}}}", "values": "_x3 1x60"},
        {"series": f"{counter}{{{_labels(1, result='reproducible')}}}", "values": "1x47 2x16"},
    ]
    exprs = [
        {
            "expr": f"round({query})",
            "eval_time": "5m",
            "exp_samples": [
                {"labels": f"{{{_labels(0, result='transient')}}}", "value": 1},
                {"labels": f"{{{_labels(1, result='reproducible')}}}", "value": 1},
            ],
        },
        {
            "expr": f"round({query})",
            "eval_time": "13m",
            "exp_samples": [{"labels": f"{{{_labels(1, result='reproducible')}}}", "value": 1}],
        },
        {"expr": query, "eval_time": "22m30s", "exp_samples": []},
    ]
    promtool_test_queries(tmp_path / "reruns-status-test.yml", series, exprs)


def test_a_gap_in_the_scrapes_counts_no_old_fault_again_on_promtool(tmp_path: Path) -> None:
    """The rerun and FP8 counts as sent, on Prometheus' own engine, 10 minutes after gaps: a
    failed scrape's staleness marker at the window's start does not make an old counter new
    (the alerts count alike: deploy/prometheus/tests/ampscope-gaps-test.yml); a fault during
    a gap, one after an exporter restart and a first one count once each."""
    t = Thresholds()
    queries = prometheus.queries(RUN, t)
    families = {
        "reruns": ("ampscope_reruns_total", {"result": "transient"}),
        "fp8_nonfinite": (
            "ampscope_fp8_nonfinite_amax_total",
            {"layer": "layers.0", "tensor": "input"},
        ),
    }
    # Values every 15 s to 41m, each rank on its own exporter (a failed scrape writes up 0
    # and a staleness marker on each of its series). Rank 0: a fault at 45s, one failed
    # scrape at 29m45s. Rank 1: scrapes fail from 25m to 33m, and a fault happened meanwhile
    # (back at 2). Rank 2: its exporter restarts at 25m and counts from zero (the counter is
    # gone while scrapes succeed) until a new fault at 33m. Rank 3: its first fault at 35m.
    shapes = {
        0: ("_x3 1x115 stale 1x45", "1x118 0 1x45"),
        1: ("_x3 1x96 stale _x31 2x32", "1x99 0x31 1x32"),
        2: ("_x3 1x96 stale _x31 1x32", "1x99 0x3 1x60"),
        3: ("_x140 1x24", "1x164"),
    }
    series: list[dict[str, Any]] = []
    exprs: list[dict[str, Any]] = []
    for rank, (counter, up) in shapes.items():
        target = {"job": "ampscope", "instance": f"n{rank}:9478"}
        series.append({"series": f'up{{job="ampscope",instance="n{rank}:9478"}}', "values": up})
        for family, more in families.values():
            labels = _labels(rank, **target, **more)
            series.append({"series": f"{family}{{{labels}}}", "values": counter})
    for name, (_, more) in families.items():
        counted = [
            {"labels": f"{{{_labels(r, job='ampscope', instance=f'n{r}:9478', **more)}}}",
             "value": 1}
            for r in (1, 2, 3)
        ]  # fmt: skip
        exprs.append({"expr": f"round({queries[name]})", "eval_time": "39m45s",
                      "exp_samples": counted})  # fmt: skip
    promtool_test_queries(tmp_path / "gaps-status-test.yml", series, exprs)


def _sample(name: str, rank: int, value: float, **labels: str) -> dict[str, Any]:
    metric = {"__name__": name, "run": RUN, "node": "n0", "rank": str(rank),
              "local_rank": str(rank), **labels}  # fmt: skip
    return {"metric": metric, "value": [NOW, repr(value)]}


def test_the_aligned_step_and_scale_come_from_the_packed_sample() -> None:
    """Where a store paired a new aligned step with the old scale, the packed sample holds
    the pair the exporter served; exporters without it still give the two series."""
    samples = []
    for rank in range(2):
        samples += [
            _sample("ampscope_rank_info", rank, 1.0, mode="scaler", world_size="3"),
            _sample("ampscope_last_report_timestamp_seconds", rank, NOW - 1),
        ]
    samples += [
        # rank 0: the separate series mix two scrapes (step 20, the scale of step 10).
        _sample("ampscope_loss_scale_aligned", 0, 65536.0),
        _sample("ampscope_loss_scale_aligned_step", 0, 20.0),
        _sample("ampscope_loss_scale_aligned_packed", 0, pack(20, 32768.0)),
        # rank 1: an exporter that predates the packed series.
        _sample("ampscope_loss_scale_aligned", 1, 32768.0),
        _sample("ampscope_loss_scale_aligned_step", 1, 20.0),
    ]
    views = build_views(samples, NOW)
    assert views[(RUN, 0)]["totals"]["aligned_scale"] == {"step": 20, "scale": 32768.0}
    assert views[(RUN, 1)]["totals"]["aligned_scale"] == {"step": 20, "scale": 32768.0}
    # Either order of the samples.
    views = build_views(list(reversed(samples)), NOW)
    assert views[(RUN, 0)]["totals"]["aligned_scale"] == {"step": 20, "scale": 32768.0}


def test_the_collapse_reference_is_the_clean_scale_on_promtool(tmp_path: Path) -> None:
    """The scale status --prometheus measures a fall from, on Prometheus' own engine: a rank
    whose reporter has the fault rule falls from its clean scale (none during a warm-up from
    2**40, so the warm-up is no collapse), an older reporter's rank from its peak."""
    t = Thresholds()
    query = prometheus.queries(RUN, t)["peak"]
    warm, old = _labels(0), _labels(1)
    series = [
        # rank 0: a warm-up from 2**40 that settles at 2**15: no clean scale for 2 minutes.
        {"series": f"ampscope_loss_scale{{{warm}}}", "values": "1099511627776 32768x40"},
        {"series": f"ampscope_loss_scale_clean{{{warm}}}", "values": "_x8 32768x32"},
        {
            "series": f"ampscope_faults_total{{{_labels(0, kind='nonfinite_loss')}}}",
            "values": "0x40",
        },
        # rank 1 predates the rule: its peak is its highest scale.
        {"series": f"ampscope_loss_scale{{{old}}}", "values": "65536x10 256x30"},
    ]
    exprs = [
        {
            "expr": query,
            "eval_time": "1m",
            "exp_samples": [{"labels": f"{{{old}}}", "value": 65536}],
        },
        {
            "expr": query,
            "eval_time": "5m",
            "exp_samples": [
                {"labels": f"{{{warm}}}", "value": 32768},
                {"labels": f"{{{old}}}", "value": 65536},
            ],
        },
    ]
    promtool_test_queries(tmp_path / "collapse-status-test.yml", series, exprs)


def test_the_windowed_counts_answer_with_the_ranks_that_counted_on_promtool(
    tmp_path: Path,
) -> None:
    """On Prometheus' own engine, the windowed queries of a job where one rank of four skipped
    steps, spiked and diverged answer with that rank only (a healthy rank's zero is what the
    rules read where a rank has no series): spikes and skips above zero, the diverged
    replica checks and not the agreeing ones. The steps are no first-round query: the
    second round asks them of the ranks that skipped."""
    t = Thresholds()
    asked = prometheus.queries(RUN, t)
    assert "steps" not in asked
    assert (t.skip_storm_window_s, t.spike_verdict_window_s) == (300, 600)
    series = []
    for rank in range(4):
        hot = rank == 2
        series += [
            {"series": f"ampscope_steps_total{{{_labels(rank)}}}", "values": "0+1x60"},
            {
                "series": f"ampscope_skipped_steps_total{{{_labels(rank)}}}",
                "values": "0x40 0+1x20" if hot else "0x60",
            },
            {
                "series": f"ampscope_spikes_total{{{_labels(rank, kind='loss')}}}",
                "values": "0x40 1x20" if hot else "0x60",
            },
            {
                "series": f"ampscope_replica_checks_total{{{_labels(rank, result='agree')}}}",
                "values": "1+1x60",
            },
        ]
    series.append(
        {
            "series": f"ampscope_replica_checks_total{{{_labels(2, result='diverged')}}}",
            "values": "_x40 1x20",
        }
    )
    hot = _labels(2)

    def at(name: str, when: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return {"expr": f"round({asked[name]})", "eval_time": when, "exp_samples": samples}

    exprs = [
        # Before anything happened: nothing to answer.
        *(
            {"expr": asked[name], "eval_time": "9m", "exp_samples": []}
            for name in ("skipped", "spikes", "skipped_nonfinite")
        ),
        {"expr": asked["replica_checks"], "eval_time": "9m", "exp_samples": []},
        # Rank 2 skipped 19 of the 300 s window's 20 steps, every one since 10m.
        at("skipped", "15m", [{"labels": f"{{{hot}}}", "value": 19}]),
        at("skipped_nonfinite", "15m", [{"labels": f"{{{hot}}}", "value": 19}]),
        at(
            "spikes",
            "15m",
            [{"labels": f"{{{_labels(2, kind='loss')}}}", "value": 1}],
        ),
        at(
            "replica_checks",
            "15m",
            [{"labels": f"{{{_labels(2, result='diverged')}}}", "value": 1}],
        ),
    ]
    promtool_test_queries(tmp_path / "standouts-status-test.yml", series, exprs)


def test_storm_and_hotspot_counts_leave_out_the_scalers_weather_on_promtool(
    tmp_path: Path,
) -> None:
    """On Prometheus' own engine, ``skip_storm``'s and ``inf_hotspot``'s windowed counts leave
    out what the fault rule called the loss scaler's weather: rank 0's warm-up backoffs (all
    weather) count nothing; rank 1's skips after its warm-up count, its warm-up's do not;
    rank 2, whose reporter predates the weather count, counts every skip, as before."""
    t = Thresholds()
    asked = prometheus.queries(RUN, t)
    series: list[dict[str, Any]] = []
    warmup = "0 1 2 3 4 5x56"
    counts = {
        # rank: (skips and local detections, their weather part; None: an old reporter)
        0: (warmup, warmup),
        1: ("0 1 2 3 4 5x28 6+1x27", warmup),
        2: (warmup, None),
    }
    for rank, (skipped, weather) in counts.items():
        cpu = _labels(rank, device="cpu")
        series += [
            {"series": f"ampscope_steps_total{{{_labels(rank)}}}", "values": "0+1x60"},
            {"series": f"ampscope_skipped_steps_total{{{_labels(rank)}}}", "values": skipped},
            {"series": f"ampscope_found_inf_total{{{cpu}}}", "values": skipped},
        ]
        if weather is not None:
            series += [
                {
                    "series": f"ampscope_weather_skipped_steps_total{{{_labels(rank)}}}",
                    "values": weather,
                },
                {"series": f"ampscope_weather_found_inf_total{{{cpu}}}", "values": weather},
            ]

    def at(name: str, when: str, samples: list[tuple[str, float]]) -> dict[str, Any]:
        expected = [{"labels": f"{{{labels}}}", "value": v} for labels, v in samples]
        return {"expr": f"round({asked[name]})", "eval_time": when, "exp_samples": expected}

    exprs = [
        # Within the warm-up's window: only the old reporter's rank 2 counts its backoffs.
        at("skipped", "2m", [(_labels(2), 5)]),
        at(
            "inf_local",
            "2m",
            [(_labels(r, device="cpu"), n) for r, n in ((0, 0), (1, 0), (2, 5))],
        ),
        # Rank 1's faults of the windows count (20 of 300 s, 27 of 600 s); the warm-ups left them.
        at("skipped", "15m", [(_labels(1), 20)]),
        at(
            "inf_local",
            "15m",
            [(_labels(r, device="cpu"), n) for r, n in ((0, 0), (1, 27), (2, 0))],
        ),
    ]
    promtool_test_queries(tmp_path / "weather-status-test.yml", series, exprs)


class _Answers:
    """A ``PrometheusClient`` that answers each query by its name in ``queries`` (the first
    round's) or by a second-round builder's PromQL, and records what it was asked."""

    url = "http://prometheus.test"

    def __init__(self, first: dict[str, list[dict[str, Any]]], t: Thresholds) -> None:
        self.by_promql = {q: first.get(name, []) for name, q in prometheus.queries(RUN, t).items()}
        self.asked: list[str] = []

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        self.asked.append(promql)
        return self.by_promql.get(promql, [])


def _metric(name: str, rank: int, **more: str) -> dict[str, str]:
    labels = {"run": RUN, "node": "n0", "rank": str(rank), "local_rank": str(rank)}
    return {"__name__": name, **labels, **more}


def test_the_second_round_asks_only_what_the_first_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four scalers with the packed aligned sample, all running, rank 3 skipping: the second
    round asks the steps of rank 3 alone, and neither the other states nor the separate
    aligned pair; the skip storm is judged from them. Without a skip, no second round."""
    from ampscope.status.prometheus import health
    from ampscope.status.prometheus.ranks import narrowed

    t = Thresholds()
    now = []
    for rank in range(4):
        now += [
            {"metric": _metric("ampscope_rank_info", rank, mode="scaler", world_size="4"),
             "value": [NOW, "1"]},
            {"metric": _metric("ampscope_last_report_timestamp_seconds", rank),
             "value": [NOW, str(NOW)]},
            {"metric": _metric("ampscope_loss_scale_aligned_packed", rank),
             "value": [NOW, str(pack(100, 65536.0))]},
            {"metric": _metric("ampscope_steps_total", rank), "value": [NOW, "100"]},
            {"metric": _metric("ampscope_skipped_steps_total", rank),
             "value": [NOW, "12" if rank == 3 else "0"]},
        ]  # fmt: skip
    state = [
        {"metric": _metric("ampscope_rank_state", r, state="running"), "value": [NOW, "1"]}
        for r in range(4)
    ]
    skipped = [{"metric": _metric("", 3), "value": [NOW, "12"]}]
    client = _Answers({"now": now, "state": state, "skipped": skipped}, t)
    steps = health.steps_query(narrowed(f'run="{RUN}"', {(RUN, 3)}), t.skip_storm_window_s)
    client.by_promql[steps] = [{"metric": _metric("", 3), "value": [NOW, "20"]}]
    first = len(client.by_promql) - 1
    monkeypatch.setattr(health, "time", SimpleNamespace(time=lambda: NOW))
    answer = health.fetch(client, RUN, t)  # type: ignore[arg-type]
    assert client.asked[first:] == [steps]
    storm = {v["rule"]: v for v in answer["health"]["verdicts"]}["skip_storm"]
    assert storm["status"] == "warning"
    assert [(r["rank"], r["steps"], r["skipped"]) for r in storm["evidence"]["ranks"]] == [
        (3, 20, 12)
    ]
    calm = _Answers({"now": now, "state": state}, t)
    health.fetch(calm, RUN, t)  # type: ignore[arg-type]
    assert len(calm.asked) == first


def test_the_collapse_reference_stays_within_the_ranks_process_on_promtool(
    tmp_path: Path,
) -> None:
    """A rank restarted with the same run id keeps its labels; the reference is taken within
    its current process, as the exporter's window starts again at a new process and as
    ``AmpscopeScaleCollapse`` takes it: after a reset of ``ampscope_steps_total`` within the
    window, the current clean scale (the new process's), none for an older reporter's rank;
    a rank that did not restart keeps the window's peak."""
    t = Thresholds()
    query = prometheus.queries(RUN, t)["peak"]
    resumed, old, collapsed, steady = _labels(0), _labels(1), _labels(2), _labels(3)
    restart = "4000+4x20 1+4x40"  # the process restarts at 5m15s
    series = [
        # rank 0: grew to 2**24, resumes at 5m15s from an older checkpoint at 2**14.
        {"series": f"ampscope_loss_scale{{{resumed}}}", "values": "16777216x20 16384x40"},
        {"series": f"ampscope_loss_scale_clean{{{resumed}}}", "values": "16777216x20 _x2 16384x37"},
        {"series": f"ampscope_steps_total{{{resumed}}}", "values": restart},
        # rank 1 predates the fault rule; its unsaved scaler starts again at 2**16.
        {"series": f"ampscope_loss_scale{{{old}}}", "values": "16777216x20 65536x40"},
        {"series": f"ampscope_steps_total{{{old}}}", "values": restart},
        # rank 2: the new process trains cleanly at 2**16, then overflows down to 128.
        {"series": f"ampscope_loss_scale{{{collapsed}}}", "values": "16777216x20 65536x12 128x28"},
        {
            "series": f"ampscope_loss_scale_clean{{{collapsed}}}",
            "values": "16777216x20 _x2 65536x38",
        },
        {"series": f"ampscope_steps_total{{{collapsed}}}", "values": restart},
        # rank 3: one process; its clean scale fell from 2**24 to 2**16 in clean steps.
        {"series": f"ampscope_loss_scale{{{steady}}}", "values": "16777216x20 65536x40"},
        {"series": f"ampscope_loss_scale_clean{{{steady}}}", "values": "16777216x20 65536x40"},
        {"series": f"ampscope_steps_total{{{steady}}}", "values": "0+4x60"},
        *(
            {
                "series": f"ampscope_faults_total{{{_labels(r, kind='nonfinite_loss')}}}",
                "values": "0x60",
            }
            for r in (0, 2, 3)
        ),
    ]
    exprs = [
        {
            "expr": query,
            "eval_time": "10m",
            "exp_samples": [
                {"labels": f"{{{resumed}}}", "value": 16384},
                {"labels": f"{{{collapsed}}}", "value": 65536},
                {"labels": f"{{{steady}}}", "value": 16777216},
            ],
        },
        {
            # The restart has left the window: every rank's peak again.
            "expr": query,
            "eval_time": "16m",
            "exp_samples": [
                {"labels": f"{{{resumed}}}", "value": 16384},
                {"labels": f"{{{old}}}", "value": 65536},
                {"labels": f"{{{collapsed}}}", "value": 65536},
                {"labels": f"{{{steady}}}", "value": 65536},
            ],
        },
    ]
    promtool_test_queries(tmp_path / "collapse-restart-status-test.yml", series, exprs)
