"""``ampscope status --prometheus``'s FP8 verdicts: the queries' PromQL on promtool's engine,
and the verdicts built from their answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support import promtool_test_queries

from ampscope.status import prometheus
from ampscope.status.prometheus import fp8 as prometheus_fp8
from ampscope.status.prometheus.ranks import build_views
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.thresholds import Thresholds

RUN = "fp8-run"
NOW = 1_700_000_000.0


def _labels(rank: int, **more: str) -> dict[str, str]:
    return {"run": RUN, "node": f"n{rank // 2}", "rank": str(rank),
            "local_rank": str(rank % 2), **more}  # fmt: skip


def _sample(name: str, rank: int, value: float, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": name, **_labels(rank, **labels)}, "value": [NOW, str(value)]}


def _text(rank: int, layer: str, tensor: str, name: str = "") -> str:
    """A series in promtool's notation."""
    labels = ",".join(f'{k}="{v}"' for k, v in _labels(rank, layer=layer, tensor=tensor).items())
    return f"{name}{{{labels}}}"


def _series(name: str, rank: int, layer: str, tensor: str, values: str) -> dict[str, str]:
    return {"series": _text(rank, layer, tensor, name), "values": values}


def test_the_queries_find_a_nan_amax_and_lasting_underflow_on_promtool(tmp_path: Path) -> None:
    """The PromQL as ``status --prometheus`` sends it, evaluated by Prometheus' own engine:
    a non-finite amax counted within 600 s (the exporter counts unskipped iterations only),
    and underflow above 10 % in every sample of 600 s (at least 5)."""
    asked = prometheus_fp8.queries(f'run="{RUN}"', Fp8Rule())
    amax, ratio = "ampscope_fp8_amax", "ampscope_fp8_underflow_ratio"
    counter = "ampscope_fp8_nonfinite_amax_total"
    skipped = ",".join(f'{k}="{v}"' for k, v in _labels(2).items())
    series = [
        # rank 0: a non-finite amax at 4m45s (the counter appears); rank 1: finite; rank 2: a
        # NaN gauge sample on a step it skipped (a backoff): the exporter counted none. The
        # gauge's NaN is what VictoriaMetrics drops: the query never reads it.
        _series(counter, 0, "layers.0", "input", "_x18 1x21"),
        _series(amax, 0, "layers.0", "input", "1x40"),
        _series(amax, 1, "layers.0", "input", "1x40"),
        _series(amax, 2, "layers.0", "grad_output", "1x19 NaN 1x20"),
        {"series": f"ampscope_skipped_steps_total{{{skipped}}}", "values": "0x19 1x21"},
        # rank 0: 30 % throughout; rank 1: 30 % with one dip to 5 %.
        _series(ratio, 0, "layers.1", "grad_output", "0.3x40"),
        _series(ratio, 1, "layers.1", "grad_output", "0.3x30 0.05 0.3x9"),
    ]

    def counted(expr: str) -> str:
        return f"count by (rank, layer, tensor) ({expr})"

    exprs = [
        {
            "expr": counted(asked["fp8_nonfinite"]),
            "eval_time": "8m",
            "exp_samples": [{"labels": '{rank="0",layer="layers.0",tensor="input"}', "value": 1}],
        },
        # 600 s after the observation it has left the window.
        {
            "expr": counted(asked["fp8_nonfinite"]),
            "eval_time": "15m1s",
            "exp_samples": [],
        },
        # The lowest sample of each series (the verdict compares it with the
        # ratio): rank 1's dip shows.
        {
            "expr": asked["fp8_underflow"],
            "eval_time": "10m",
            "exp_samples": [
                {"labels": _text(0, "layers.1", "grad_output"), "value": 0.3},
                {"labels": _text(1, "layers.1", "grad_output"), "value": 0.05},
            ],
        },
    ]
    promtool_test_queries(tmp_path / "fp8-status-test.yml", series, exprs)


def _views() -> list[dict[str, Any]]:
    samples = []
    for rank in range(4):
        samples += [
            _sample("ampscope_rank_info", rank, 1.0, mode="watch", world_size="4"),
            _sample("ampscope_last_report_timestamp_seconds", rank, NOW - 1),
            _sample("ampscope_rank_up", rank, 1.0),
            _sample("ampscope_rank_state", rank, 1.0, state="running"),
        ]
    return sorted(build_views(samples, NOW).values(), key=lambda v: v["rank"])


def _health(fp8: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    t = Thresholds()
    skip = ("now", *prometheus_fp8.FP8_QUERIES)
    windows: dict = {name: {} for name in prometheus.queries(RUN, t) if name not in skip}
    report = prometheus.health_of(RUN, _views(), windows, t, NOW, (), fp8)
    return {v["rule"]: v for v in report["verdicts"]}


def test_fp8_verdicts_from_the_answers_name_rank_layer_and_tensor_without_a_step() -> None:
    ratio = "ampscope_fp8_underflow_ratio"
    now = [
        _sample(ratio, 0, 0.32, layer="layers.1", tensor="grad_output"),
        _sample(ratio, 1, 0.45, layer="layers.1", tensor="grad_output"),
        _sample(ratio, 2, 0.01, layer="layers.0", tensor="input"),
        _sample(ratio, 3, 0.2, layer="layers.0", tensor="input"),
    ]
    fp8 = {
        "fp8_now": now,
        "fp8_nonfinite": [
            {"metric": _labels(2, layer="layers.0", tensor="input"), "value": [NOW, "NaN"]}
        ],
        # Rank 3's lowest sample is 8 %: not lasting.
        "fp8_underflow": [
            {"metric": _labels(0, layer="layers.1", tensor="grad_output"), "value": [NOW, "0.3"]},
            {"metric": _labels(1, layer="layers.1", tensor="grad_output"), "value": [NOW, "0.4"]},
            {"metric": _labels(3, layer="layers.0", tensor="input"), "value": [NOW, "0.08"]},
        ],
    }
    verdicts = _health(fp8)
    underflow = verdicts["fp8_underflow"]
    assert underflow["status"] == "warning"
    assert [
        (s["rank"], s["node"], s["layer"], s["ratio"]) for s in underflow["evidence"]["series"]
    ] == [
        (1, "n0", "layers.1", 0.45),
        (0, "n0", "layers.1", 0.32),
    ]
    assert underflow["summary"].startswith(
        "FP8 casts underflow in 2 series: rank 1 layer layers.1 grad_output turns 45% of its"
    )
    detail = prometheus_fp8.FP8_DETAIL.format(window=600, run=RUN)
    assert underflow["summary"].endswith(f"({detail})")
    nonfinite = verdicts["fp8_nonfinite_amax"]
    assert nonfinite["status"] == "critical"
    # Prometheus holds no step: the summary names none.
    assert nonfinite["summary"] == (
        f"FP8 amax not finite in 1 series: first rank 2 layer layers.0 input ({detail})"
    )
    assert nonfinite["evidence"]["series"] == [
        {"rank": 2, "node": "n1", "layer": "layers.0", "tensor": "input", "step": None}
    ]
    spike = verdicts["fp8_amax_spike"]
    assert (spike["status"], spike["evidence"]) == ("ok", {"evaluated": False})
    assert "previous observations" in spike["summary"]


def test_a_run_without_fp8_series_has_no_fp8_verdicts() -> None:
    verdicts = _health({name: [] for name in prometheus_fp8.FP8_QUERIES})
    assert not [rule for rule in verdicts if rule.startswith("fp8_")]
    calm = _health(
        {
            "fp8_now": [_sample("ampscope_fp8_underflow_ratio", 0, 0.0, layer="l", tensor="input")],
            "fp8_nonfinite": [],
            "fp8_underflow": [],
        }
    )
    assert calm["fp8_underflow"]["summary"] == "FP8 underflow within bounds in 1 series"
    assert calm["fp8_nonfinite_amax"]["status"] == "ok"
