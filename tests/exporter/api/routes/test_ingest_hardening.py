"""Regression tests of issue 8's reproduced data attacks: each once broke the exporter."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ampscope.exporter.state.store import Store
from ampscope.reporter.schema import MAX_COUNT, IngestBatch, RankTotals, StepRecord, WeatherTotals
from exporter.conftest import MakeClient
from exporter.factory import T0, batch, body, record, steps, totals

URL = "/api/v1/ingest"


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def _value(client: TestClient, name: str, **labels: str) -> float:
    matches = [
        value
        for (sample, got), value in _samples(client).items()
        if sample == name and labels.items() <= dict(got).items()
    ]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def _rejected(client: TestClient, reason: str) -> float:
    return _value(client, "ampscope_exporter_ingest_rejections_total", reason=reason)


def _post(client: TestClient, *records: StepRecord, dropped: int = 0) -> int:
    return client.post(URL, content=body(*records, dropped=dropped)).status_code


# Item 1: counts too large for a float64 blinded /metrics and /health.


def test_counts_beyond_float64_exactness_are_rejected(client: TestClient) -> None:
    doc = json.loads(body(record(1)))
    doc["dropped_records"] = 10**310
    assert client.post(URL, content=json.dumps(doc)).status_code == 422
    doc["dropped_records"] = MAX_COUNT + 1
    assert client.post(URL, content=json.dumps(doc)).status_code == 422
    doc["dropped_records"] = MAX_COUNT  # the bound itself is exact and accepted
    doc["records"][0]["totals"]["skipped_steps"] = MAX_COUNT
    doc["records"][0]["totals"]["steps"] = MAX_COUNT
    assert client.post(URL, content=json.dumps(doc)).status_code == 200
    assert _value(client, "ampscope_reporter_dropped_records_total") == float(MAX_COUNT)
    assert client.get("/api/v1/runs/run-a/health").status_code == 200


def test_times_after_2100_are_rejected(client: TestClient) -> None:
    doc = json.loads(body(record(1)))
    doc["records"][0]["time"] = 1e12
    response = client.post(URL, content=json.dumps(doc))
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["records", 0, "time"]


def test_a_rank_that_cannot_be_rendered_is_left_out_alone(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    # Validation makes such a rank impossible through the API; build one past it to
    # prove the collector and health isolate it rather than fail for everyone.
    assert _post(client, record(1, rank=1)) == 200
    good = record(1)
    bad_totals = RankTotals.model_construct(**{**dict(good.totals), "skipped_steps": 10**310})
    bad = StepRecord.model_construct(**{**dict(good), "totals": bad_totals})
    store: Store = client.app.state.store  # type: ignore[attr-defined]
    store.ingest(
        IngestBatch.model_construct(schema_version=1, records=[bad], dropped_records=0), T0
    )
    with caplog.at_level(logging.ERROR, logger="ampscope.exporter.metrics.collector"):
        assert _value(client, "ampscope_exporter_unrenderable_ranks") == 1
        assert _value(client, "ampscope_steps_total", rank="1") == 1
    assert len(caplog.records) == 1  # two scrapes, one log line
    assert "rank 0 of run 'run-a' left out of /metrics" in caplog.records[0].getMessage()
    assert not [k for k in _samples(client) if dict(k[1]).get("rank") == "0"]
    health = client.get("/api/v1/runs/run-a/health")
    assert health.status_code == 200
    assert health.json()["ranks"] == 2


# Item 2: a restart batch bypassed max_series.


def test_series_are_counted_on_the_record_that_ends_up_newest(make_client: MakeClient) -> None:
    client, clock = make_client(max_series=27)
    assert _post(client, record(50)) == 200  # 18 per-rank series + 1 device
    many = totals(2, local={f"cuda:{i}": 0 for i in range(16)}, params={"w": 1})
    clock.advance(100)
    # The lower step, produced later, is a restart and would end up newest with 35 series.
    restart = [record(60), record(2, time=T0 + 100, total=many)]
    response = client.post(URL, content=body(*restart))
    assert response.status_code == 429
    assert response.json()["limit"] == "max_series"
    assert _value(client, "ampscope_exporter_tracked_series") == 19
    assert _value(client, "ampscope_last_step") == 50  # nothing of the batch applied


# Item 6: duplicate parameter names exposed two samples with one label set.


def test_duplicate_parameter_names_are_rejected(client: TestClient) -> None:
    doc = json.loads(body(record(1, total=totals(1, params={"w": 1}))))
    doc["records"][0]["totals"]["nonfinite_params"].append({"name": "w", "count": 2})
    response = client.post(URL, content=json.dumps(doc))
    assert response.status_code == 422
    assert "listed twice" in response.json()["detail"]
    doc = json.loads(body(record(1)))
    doc["records"][0]["nonfinite_params"] = [{"name": "v", "count": 1}] * 2
    assert client.post(URL, content=json.dumps(doc)).status_code == 422


# Item 7: run ids with "/" were shown on /metrics but no API path reached them.


def test_run_ids_are_single_path_segments(client: TestClient) -> None:
    for run in ("a/b", ".", "..", ".hidden", "a b"):
        doc = json.loads(body(record(1)))
        doc["records"][0]["identity"]["run"] = run
        response = client.post(URL, content=json.dumps(doc))
        assert response.status_code == 422, run
        assert response.json()["errors"][0]["loc"][-1] == "run"
    odd = "job:7@host+x=y_1.2-3"
    assert _post(client, record(1, run=odd)) == 200
    listing = client.get("/api/v1/runs").json()
    assert [run["run"] for run in listing] == [odd]
    assert client.get(f"/api/v1/runs/{odd}/ranks/0").status_code == 200
    assert client.get(f"/api/v1/runs/{odd}/health").status_code == 200


# Item 8: a rank's clock and identity were taken on trust.


def test_records_far_ahead_of_the_exporter_clock_are_refused(make_client: MakeClient) -> None:
    client, _ = make_client(max_clock_skew_s=300)
    assert _post(client, *steps(1, 5)) == 200
    forged = client.post(URL, content=body(record(1, time=T0 + 10**6)))
    assert forged.status_code == 422
    assert forged.json()["error"] == "clock_skew"
    assert _rejected(client, "clock_skew") == 1
    assert _post(client, *steps(6, 8)) == 200  # genuine batches still count
    assert _value(client, "ampscope_steps_total") == 8


def test_a_restart_timed_ahead_within_the_skew_cannot_freeze_the_rank(
    make_client: MakeClient,
) -> None:
    client, _ = make_client(max_clock_skew_s=300)
    assert _post(client, *steps(1, 5)) == 200
    assert _post(client, record(1, time=T0 + 290)) == 200  # forged restart, 285 s ahead
    # The genuine process goes on: its records are older than the forged one's time but
    # not than the exporter's receive time, so they are not taken for a dead process.
    assert _post(client, *steps(6, 8)) == 200
    assert _value(client, "ampscope_last_step") == 8
    assert _value(client, "ampscope_steps_total") == 8


def test_a_live_rank_cannot_be_relabelled(client: TestClient) -> None:
    assert _post(client, *steps(1, 5)) == 200
    # Another scheduler job reusing the run id is another process, as another node is.
    changes: list[dict[str, Any]] = [{"node": "elsewhere"}, {"world_size": 64}, {"job_id": "42"}]
    for change in changes:
        forged = client.post(URL, content=body(record(6, **change)))
        assert forged.status_code == 409
        assert forged.json()["error"] == "identity_conflict"
    assert "job_id 42; the live rank is node 'node0'" in forged.json()["detail"]
    forged = client.post(URL, content=body(*steps(6, 7), record(8, rank=0, node="elsewhere")))
    assert forged.status_code == 409
    assert _rejected(client, "identity_conflict") == 4
    assert _post(client, *steps(6, 7)) == 200  # the genuine rank: no spurious restart
    rank = client.get("/api/v1/runs/run-a/ranks/0").json()
    assert (rank["node"], rank["step"], rank["restarts"]) == ("node0", 7, 0)
    # A restart (a lower step, produced later) may move the rank to another node and
    # another scheduler job (a requeue keeps the run id, not the job id).
    assert _post(client, record(1, time=T0 + 100, node="elsewhere", job_id="43")) == 200
    assert _post(client, record(2, time=T0 + 101, node="elsewhere", job_id="43")) == 200
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["node"] == "elsewhere"


# Item 9: restart detection looked at four counters; per-device found-inf fell silently.


def test_any_counter_falling_is_a_restart(make_client: MakeClient) -> None:
    client, _ = make_client()
    assert _post(client, record(10, total=totals(10, local={"cuda:0": 5}))) == 200
    assert _post(client, record(20, time=T0 + 20, total=totals(20, local={"cuda:0": 1}))) == 200
    assert _value(client, "ampscope_found_inf_total", device="cuda:0") == 1
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["restarts"] == 1
    params = totals(30, local={"cuda:0": 1}, params={"w": 9})
    assert _post(client, record(30, time=T0 + 30, total=params)) == 200
    fewer = totals(40, local={"cuda:0": 1}, params={"w": 3})
    assert _post(client, record(40, time=T0 + 40, total=fewer)) == 200
    assert client.get("/api/v1/runs/run-a/ranks/0").json()["restarts"] == 2
    assert _value(client, "ampscope_nonfinite_grads_total", param="w") == 3


def test_batches_of_a_new_rank_are_checked_for_identity_changes_too(
    client: TestClient,
) -> None:
    forged = batch(record(1), record(2, node="elsewhere"))
    response = client.post(URL, content=forged.model_dump_json())
    assert response.status_code == 409
    assert client.get("/api/v1/runs").json() == []


# Weather (the loss scaler's part of the skip and found-inf counters) above its totals made
# PromQL's total - weather negative, and a device only the weather named had no total.


def _weathered(step: int, skipped: int, weather: int, **changes: Any) -> str:
    """A batch of one record: ``skipped`` skips on cuda:0 (origin tracked there), ``weather``
    of them the scaler's weather, with ``changes`` (dotted paths under ``weather``) on top."""
    part = WeatherTotals(
        skipped_steps=weather,
        found_inf_local={"cuda:0": weather},
        found_inf_origin={"cuda:0": weather},
    )
    total = totals(step, skipped=skipped, origin={"cuda:0": skipped}, weather=part)
    doc = json.loads(body(record(step, total=total)))
    for path, value in changes.items():
        *keys, last = path.split(".")
        held = doc["records"][0]["totals"]["weather"]
        for key in keys:
            held = held[key]
        held[last] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"skipped_steps": 4}, "weather.skipped_steps (4) exceeds skipped_steps (3)"),
        (
            {"found_inf_local.cuda:0": 4},
            "weather.found_inf_local['cuda:0'] (4) exceeds found_inf_local['cuda:0'] (3)",
        ),
        (
            {"found_inf_origin.cuda:0": 4},
            "weather.found_inf_origin['cuda:0'] (4) exceeds found_inf_origin['cuda:0'] (3)",
        ),
        (
            {"found_inf_local.cuda:1": 0},
            "weather.found_inf_local names device 'cuda:1', which found_inf_local does not hold",
        ),
    ],
)
def test_weather_beyond_its_totals_is_refused_and_changes_nothing(
    client: TestClient, changes: dict[str, int], message: str
) -> None:
    assert client.post(URL, content=_weathered(10, 3, 2)).status_code == 200
    response = client.post(URL, content=_weathered(11, 3, 3, **changes))
    assert response.status_code == 422
    answer = response.json()
    assert answer["error"] == "invalid"
    assert answer["errors"][0]["loc"] == ["records", 0, "totals"]
    assert message in answer["detail"]
    assert _rejected(client, "invalid") == 1
    # The rank keeps its last accepted record: step, totals and weather as they were.
    assert _value(client, "ampscope_last_step") == 10
    assert _value(client, "ampscope_weather_skipped_steps_total") == 2
    assert _value(client, "ampscope_weather_found_inf_total", device="cuda:0") == 2
    assert _value(client, "ampscope_weather_found_inf_origin_total", device="cuda:0") == 2
    assert not [k for k in _samples(client) if dict(k[1]).get("device") == "cuda:1"]
    # The same record within its totals is taken.
    assert client.post(URL, content=_weathered(11, 3, 3)).status_code == 200
    assert _value(client, "ampscope_weather_found_inf_origin_total", device="cuda:0") == 3
