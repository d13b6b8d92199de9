"""One error body for every error of every endpoint, and an OpenAPI that says so."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.testclient import TestClient

from ampscope.exporter.app import create_app
from ampscope.exporter.settings import Settings
from exporter.conftest import MakeClient

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def _is_error_body(body: Any, error: str) -> None:
    assert isinstance(body, dict), body
    assert body["error"] == error, body
    assert isinstance(body["detail"], str)
    assert body["detail"]
    assert set(body) <= {"error", "detail", "limit", "value", "errors"}


def test_framework_errors_use_the_error_body(client: TestClient) -> None:
    response = client.get("/api/v1/nothing-here")
    assert response.status_code == 404
    _is_error_body(response.json(), "not_found")
    response = client.put("/api/v1/ingest", content=b"{}")
    assert response.status_code == 405
    _is_error_body(response.json(), "method_not_allowed")
    assert response.headers["allow"] == "POST"
    response = client.get("/api/v1/runs/r/ranks/not-a-number")
    assert response.status_code == 422
    body = response.json()
    _is_error_body(body, "invalid")
    assert body["errors"][0]["loc"] == ["path", "rank"]
    response = client.get("/api/v1/runs/r/ranks/0/history", params={"limit": "x"})
    assert response.status_code == 422
    _is_error_body(response.json(), "invalid")


def test_an_unexpected_failure_is_a_500_error_body() -> None:
    app = create_app(Settings())
    broken = APIRouter()

    @broken.get("/broken")
    def fail() -> None:
        raise RuntimeError("boom")

    app.include_router(broken)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/broken")
    assert response.status_code == 500
    _is_error_body(response.json(), "internal")
    assert "boom" not in response.text


def test_openapi_declares_the_bearer_scheme_on_ingest_and_error_bodies_everywhere(
    make_client: MakeClient,
) -> None:
    client, _ = make_client(token="secret")
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearer"]["description"],
    }
    ingest = spec["paths"]["/api/v1/ingest"]["post"]
    assert ingest["security"] == [{"bearer": []}]
    for status in ("400", "401", "408", "413", "422", "429", "default"):
        assert ingest["responses"][status]["content"]["application/json"]["schema"] == ERROR_REF
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            # Posts (ingest, heartbeat) need the token; reads stay open.
            assert ("security" in operation) == (method == "post"), (path, method)
            default = operation["responses"]["default"]
            assert default["content"]["application/json"]["schema"] == ERROR_REF
            if "422" in operation["responses"]:
                content = operation["responses"]["422"]["content"]
                assert content["application/json"]["schema"] == ERROR_REF, (path, method)
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    # The documented bearer scheme is the one enforced.
    assert client.post("/api/v1/ingest", content=b"{}").status_code == 401
    response = client.post("/api/v1/ingest", content=b"{}", headers={"Authorization": "Basic x"})
    assert response.status_code == 401
    _is_error_body(response.json(), "unauthorized")
    response = client.post(
        "/api/v1/ingest", content=b"{}", headers={"Authorization": "Bearer secret"}
    )
    assert response.status_code == 422
