"""Bodies nested past ``max_json_depth`` on every route that takes a body: a 400 that names
the limit, one count, no traceback, and /metrics still answering (issue 18)."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ampscope.exporter.api.routes.heartbeat import MAX_HEARTBEAT_BYTES
from ampscope.exporter.app import create_app
from ampscope.exporter.http.parse import MAX_JSON_DEPTH, SPLIT_ABOVE_BYTES
from ampscope.exporter.settings import Settings
from ampscope.reporter.schema import HEARTBEAT_PATH, INGEST_PATH


def deep(levels: int, kind: str) -> bytes:
    """``levels`` arrays or objects nested one inside another (the outermost included)."""
    if kind == "array":
        return b"[" * levels + b"]" * levels
    return b'{"a":' * (levels - 1) + b"{}" + b"}" * (levels - 1)


def _rejected_malformed(client: TestClient) -> float:
    response = client.get("/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        if family.name == "ampscope_exporter_ingest_rejections":
            for sample in family.samples:
                if sample.labels["reason"] == "malformed":
                    return sample.value
    raise AssertionError("no malformed count")


def test_the_body_routes_are_ingest_and_heartbeat() -> None:
    """The attacks below cover every route that reads a body; a new one must join them."""
    paths = create_app(Settings()).openapi()["paths"]
    with_body = {path for path, operations in paths.items() if operations.keys() - {"get"}}
    assert with_body == {INGEST_PATH, HEARTBEAT_PATH}


ATTACKS = [
    pytest.param(INGEST_PATH, deep(50_000, "array"), id="ingest-50k-arrays"),
    pytest.param(INGEST_PATH, deep(50_000, "object"), id="ingest-50k-objects"),
    pytest.param(INGEST_PATH, deep(MAX_JSON_DEPTH + 2, "array"), id="ingest-just-over"),
    pytest.param(
        INGEST_PATH,
        deep(MAX_JSON_DEPTH + 2, "object") + b" " * SPLIT_ABOVE_BYTES,
        id="ingest-just-over-large",
    ),
    pytest.param(HEARTBEAT_PATH, deep(MAX_JSON_DEPTH + 2, "object"), id="heartbeat-just-over"),
    pytest.param(
        HEARTBEAT_PATH, deep(MAX_HEARTBEAT_BYTES // 2, "array"), id="heartbeat-largest-deep"
    ),
]


@pytest.mark.parametrize(("path", "payload"), ATTACKS)
def test_a_body_nested_too_deep_is_a_400_naming_the_limit(
    client: TestClient, caplog: pytest.LogCaptureFixture, path: str, payload: bytes
) -> None:
    before = _rejected_malformed(client)
    with caplog.at_level(logging.DEBUG):
        response = client.post(path, content=payload)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert (answer["error"], answer["limit"], answer["value"]) == (
        "malformed",
        "max_json_depth",
        MAX_JSON_DEPTH,
    )
    assert f"deeper than max_json_depth={MAX_JSON_DEPTH}" in answer["detail"]
    assert "line 1 column" in answer["detail"]  # where the parser stopped
    # At most the refusal summary's line (the first refusal is logged at once), never a
    # traceback or a line per request.
    ours = [r for r in caplog.records if r.name.startswith("ampscope")]
    assert len(ours) <= 1
    assert not any(r.exc_info for r in caplog.records)
    assert _rejected_malformed(client) == before + 1


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("path", [INGEST_PATH, HEARTBEAT_PATH])
def test_a_body_at_the_limit_is_parsed_and_judged_by_the_schema(
    client: TestClient, path: str, kind: str
) -> None:
    response = client.post(path, content=deep(MAX_JSON_DEPTH + 1, kind))
    assert response.status_code == 422, response.text
    assert "limit" not in response.json()


def test_a_deep_heartbeat_too_large_for_its_route_is_a_413(client: TestClient) -> None:
    response = client.post(HEARTBEAT_PATH, content=deep(50_000, "object"))
    assert response.status_code == 413
    assert response.json()["limit"] == "heartbeat_bytes"
