"""POST /api/v1/ingest: accepted batches, and every way a request gets turned away."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exporter.conftest import MakeClient
from exporter.factory import body, record, steps, totals

URL = "/api/v1/ingest"


def _rejections(client: TestClient) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    (family,) = [f for f in families if f.name == "ampscope_exporter_ingest_rejections"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def _valid_json() -> dict:
    return json.loads(body(record(1)))


def test_accepts_a_batch_and_counts_it(client: TestClient) -> None:
    response = client.post(URL, content=body(*steps(1, 4), dropped=3))
    assert response.status_code == 200
    assert response.json() == {"accepted": 4, "ignored": 0, "heartbeat_interval_s": 15.0}
    again = client.post(URL, content=body(*steps(3, 5)))  # a retry overlapping the last
    assert again.json() == {"accepted": 1, "ignored": 2, "heartbeat_interval_s": 15.0}
    metrics = client.get("/metrics").text
    assert "ampscope_exporter_ingest_batches_total 2.0" in metrics
    assert "ampscope_exporter_ingest_records_total 7.0" in metrics
    assert set(_rejections(client).values()) == {0.0}


@pytest.mark.parametrize(
    ("mutate", "loc", "error_type"),
    [
        (lambda d: d["records"][0].update(step="3"), ["records", 0, "step"], "int_type"),
        (lambda d: d.update(schema_version=2), ["schema_version"], "literal_error"),
        (lambda d: d.update(extra=1), ["extra"], "extra_forbidden"),
        (lambda d: d["records"][0]["identity"].update(run="a b"), None, "string_pattern_mismatch"),
        (lambda d: d["records"][0].update(step=0), ["records", 0, "step"], "greater_than_equal"),
    ],
)
def test_schema_violations_are_422_with_locations(
    client: TestClient, mutate, loc: list | None, error_type: str
) -> None:
    data = _valid_json()
    mutate(data)
    response = client.post(URL, content=json.dumps(data))
    assert response.status_code == 422
    answer = response.json()
    assert answer["error"] == "invalid"
    first = answer["errors"][0]
    assert first["type"] == error_type
    if loc is not None:
        assert first["loc"] == loc
    assert "input" not in first  # values are not echoed back


def test_nan_and_inf_are_rejected(client: TestClient) -> None:
    text = body(record(1)).decode()
    for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
        response = client.post(
            URL, content=text.replace('"scale_after":65536.0', f'"scale_after":{bad}')
        )
        assert response.status_code == 422, bad
        assert response.json()["errors"][0]["loc"] == ["records", 0, "scale_after"]


def test_mixed_ranks_and_malformed_json(client: TestClient) -> None:
    data = _valid_json()
    data["records"].append(json.loads(body(record(2, rank=1)))["records"][0])
    mixed = client.post(URL, content=json.dumps(data))
    assert mixed.status_code == 422
    assert "one rank" in mixed.json()["detail"]
    for junk in (b"{", b"", b"\xff\xfe", b"[1, 2"):
        response = client.post(URL, content=junk)
        assert response.status_code == 400, junk
        assert response.json()["error"] == "malformed"
    assert _rejections(client)["malformed"] == 4
    assert _rejections(client)["invalid"] == 1


def test_oversized_bodies_are_413(make_client: MakeClient) -> None:
    client, _ = make_client(max_body_bytes=4096)
    big = body(*steps(1, 40))
    assert len(big) > 4096
    declared = client.post(URL, content=big)
    assert declared.status_code == 413
    assert declared.json()["limit"] == "max_body_bytes"
    assert "Content-Length" in declared.json()["detail"]
    # Chunked, no Content-Length: refused while reading.
    streamed = client.post(URL, content=iter([big[i : i + 1000] for i in range(0, len(big), 1000)]))
    assert streamed.status_code == 413
    assert "while reading" in streamed.json()["detail"]
    assert _rejections(client)["too_large"] == 2
    assert client.post(URL, content=body(*steps(1, 2))).status_code == 200


def test_records_per_batch_limit_is_413(make_client: MakeClient) -> None:
    client, _ = make_client(max_records_per_batch=3)
    response = client.post(URL, content=body(*steps(1, 4)))
    assert response.status_code == 413
    assert response.json()["limit"] == "max_records_per_batch"


def test_cardinality_limits_are_429_naming_the_limit(make_client: MakeClient) -> None:
    client, _ = make_client(
        max_runs=1, max_ranks_per_run=2, max_devices_per_rank=2, max_params_per_rank=2
    )
    assert client.post(URL, content=body(record(1, run="a"))).status_code == 200
    cases = {
        "max_runs": record(1, run="b"),
        "max_devices_per_rank": record(
            2, total=totals(2, local={"d0": 0, "d1": 0, "d2": 0}), run="a"
        ),
        "max_params_per_rank": record(
            2, total=totals(2, params={"w1": 1, "w2": 1, "w3": 1}), run="a"
        ),
    }
    for limit, rec in cases.items():
        response = client.post(URL, content=body(rec))
        assert response.status_code == 429, limit
        assert response.json()["limit"] == limit
        assert response.headers["retry-after"] == "60"
    assert client.post(URL, content=body(record(1, run="a", rank=1))).status_code == 200
    response = client.post(URL, content=body(record(1, run="a", rank=2)))
    assert (response.status_code, response.json()["limit"]) == (429, "max_ranks_per_run")
    assert _rejections(client)["cardinality"] == 4
    # Nothing of the rejected batches was kept; the exporter keeps serving.
    ranks = client.get("/api/v1/runs/a/ranks").json()
    assert [(r["rank"], r["step"]) for r in ranks] == [(0, 1), (1, 1)]
    assert client.get("/api/v1/runs").json()[0]["run"] == "a"


def test_token_guards_ingest_but_not_reads(make_client: MakeClient, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    client, _ = make_client(token_file=token_file)
    missing = client.post(URL, content=body(record(1)))
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="ampscope"'
    # Not a bearer credential at all: as good as missing (RFC 6750 section 3).
    for header in ("Basic s3cret", "s3cret"):
        response = client.post(URL, content=body(record(1)), headers={"Authorization": header})
        assert response.status_code == 401, header
    for header in ("Bearer wrong", "Bearer s3cret2"):
        response = client.post(URL, content=body(record(1)), headers={"Authorization": header})
        assert response.status_code == 401, header
        challenge = response.headers["www-authenticate"]
        assert challenge.startswith('Bearer realm="ampscope", error="invalid_token"'), challenge
        assert response.json()["error"] == "unauthorized"
    ok = client.post(URL, content=body(record(1)), headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/api/v1/runs").status_code == 200
    rejections = _rejections(client)
    assert (rejections["token_missing"], rejections["token_wrong"]) == (3, 2)
