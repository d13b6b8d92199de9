"""FP8 series in the exporter: gauges bounded by fp8_max_layers, the JSON API, and the
three FP8 verdicts judged from each rank's own history."""

from __future__ import annotations

import math

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ampscope.reporter.schema import Fp8Tensor
from exporter.conftest import MakeClient
from exporter.factory import body, record, totals, watch

URL = "/api/v1/ingest"


def _entries(layers: int, amax: float = 1.0, underflow: float = 0.0, **at: float | None):
    """Three tensors for each of ``layers`` layers; ``at`` overrides one series' amax by
    ``"layer/tensor"``."""
    out = []
    for index in range(layers):
        for tensor in ("input", "weight", "grad_output"):
            key = f"l{index}/{tensor}"
            out.append(
                Fp8Tensor(
                    layer=f"l{index}",
                    tensor=tensor,  # type: ignore[arg-type]
                    cast="grad_input_gemm" if tensor == "grad_output" else "output_gemm",
                    dtype="float8_e4m3fn",
                    rowwise=False,
                    amax=at.get(key, amax),
                    underflow_ratio=underflow + index / 1000,
                    scale=448.0,
                    scale_min=448.0,
                )
            )
    return out


def _post(client: TestClient, *records) -> None:
    response = client.post(
        URL, content=body(*records), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


def _verdicts(client: TestClient) -> dict[str, dict]:
    report = client.get("/api/v1/runs/run-a/health").json()
    return {v["rule"]: v for v in report["verdicts"]}


def _fp8_samples(client: TestClient) -> dict[tuple[str, str, str], float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name.startswith("ampscope_fp8_"):
                out[(s.name, s.labels["layer"], s.labels["tensor"])] = s.value
    return out


def test_a_spike_is_named_and_only_max_layers_are_exported(make_client: MakeClient) -> None:
    client, clock = make_client(fp8_max_layers=4)
    for step in range(1, 31):
        spike = {"l2/input": 50.0} if step == 30 else {}
        _post(client, watch(step, total=totals(step), fp8=_entries(8, **spike)))
    verdicts = _verdicts(client)
    spike = verdicts["fp8_amax_spike"]
    assert spike["status"] == "warning"
    (named,) = spike["evidence"]["series"]
    assert (named["rank"], named["layer"], named["tensor"], named["step"]) == (0, "l2", "input", 30)
    assert named["value"] == 50.0
    assert named["baseline"] == 1.0
    assert verdicts["fp8_underflow"]["status"] == "ok"
    assert verdicts["fp8_nonfinite_amax"]["status"] == "ok"
    samples = _fp8_samples(client)
    # l2 (live verdict) first, then the highest underflow: l7, l6, l5.
    assert {layer for _, layer, _ in samples} == {"l2", "l7", "l6", "l5"}
    assert samples[("ampscope_fp8_amax", "l2", "input")] == 50.0
    assert samples[("ampscope_fp8_scale", "l2", "input")] == 448.0
    assert len(samples) == 3 * 3 * 4
    # The JSON API holds every layer.
    (rank,) = client.get("/api/v1/runs/run-a/ranks").json()
    assert len(rank["fp8"]) == 8 * 3
    # The verdict ends with its window.
    clock.advance(601)
    _post(client, watch(31, time=clock.now, total=totals(31), fp8=_entries(8)))
    assert _verdicts(client)["fp8_amax_spike"]["status"] == "ok"


def test_no_spike_before_twenty_observations(make_client: MakeClient) -> None:
    client, _ = make_client()
    for step in range(1, 21):
        spike = {"l0/weight": 1e6} if step == 20 else {}
        _post(client, watch(step, total=totals(step), fp8=_entries(1, **spike)))
    assert _verdicts(client)["fp8_amax_spike"]["status"] == "ok"


def test_underflow_needs_five_observations_in_a_row(make_client: MakeClient) -> None:
    client, _ = make_client()
    for step in range(1, 5):
        _post(client, watch(step, total=totals(step), fp8=_entries(1, underflow=0.2)))
    assert _verdicts(client)["fp8_underflow"]["status"] == "ok"
    _post(client, watch(5, total=totals(5), fp8=_entries(1, underflow=0.2)))
    verdict = _verdicts(client)["fp8_underflow"]
    assert verdict["status"] == "warning"
    assert verdict["evidence"]["series_affected"] == 3
    assert verdict["evidence"]["series"][0]["ratio"] == 0.2


def test_non_finite_amax_is_critical_unless_the_scaler_skipped(make_client: MakeClient) -> None:
    client, _ = make_client()
    # A loss scaler's overflow iteration: skipped, its non-finite grad_output no FP8 fault.
    _post(client, record(1, skipped=True, total=totals(1, skipped=1),
                         fp8=_entries(1, **{"l0/grad_output": None})))  # fmt: skip
    assert _verdicts(client)["fp8_nonfinite_amax"]["status"] == "ok"
    samples = _fp8_samples(client)
    assert math.isnan(samples[("ampscope_fp8_amax", "l0", "grad_output")])
    _post(client, record(2, total=totals(2, skipped=1), fp8=_entries(1, **{"l0/input": None})))
    verdict = _verdicts(client)["fp8_nonfinite_amax"]
    assert verdict["status"] == "critical"
    assert verdict["evidence"]["series"] == [
        {"rank": 0, "node": "node0", "layer": "l0", "tensor": "input", "step": 2}
    ]
    # The alerts read a count, which every store keeps (VictoriaMetrics drops a NaN sample):
    # the unskipped iteration's input counts, the skipped one's grad_output does not.
    counted = {k: v for k, v in _fp8_samples(client).items() if k[0].endswith("_total")}
    assert counted == {("ampscope_fp8_nonfinite_amax_total", "l0", "input"): 1.0}
    _post(client, record(3, total=totals(3, skipped=1), fp8=_entries(1, **{"l0/input": None})))
    _post(client, record(4, total=totals(4, skipped=1), fp8=_entries(1)))
    samples = _fp8_samples(client)
    assert samples[("ampscope_fp8_nonfinite_amax_total", "l0", "input")] == 2.0
    assert samples[("ampscope_fp8_amax", "l0", "input")] == 1.0  # the gauge: newest only


def test_runs_without_fp8_layers_have_no_fp8_verdicts(client: TestClient) -> None:
    _post(client, record(1))
    assert not {"fp8_amax_spike", "fp8_underflow", "fp8_nonfinite_amax"} & set(_verdicts(client))
