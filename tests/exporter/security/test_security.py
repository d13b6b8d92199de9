"""Who is checked where: basic auth on reads, the token on ingest, headers everywhere."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from ampscope.exporter.app import create_app
from ampscope.exporter.security import basic_auth
from ampscope.exporter.security import policy as security_module
from ampscope.exporter.security.basic_auth import BasicAuthVerifier, parse_basic
from ampscope.exporter.security.policy import WebSecurity
from ampscope.exporter.settings import Settings
from ampscope.reporter.schema import HEARTBEAT_PATH, INGEST_PATH
from exporter.credentials import bcrypt_hash, make_leaf, make_pki
from exporter.factory import FakeClock, body, record

TOKEN = "rank-token"
HEADERS = {"X-Frame-Options": "deny", "Content-Security-Policy": "default-src 'self'"}
READS = [
    "/metrics",
    "/api/v1/runs",
    "/",
    "/ui/common.js",
    "/docs",
    "/openapi.json",
    "/api/v1/runs/x/health",
]


def _config(directory: Path, users: dict[str, str], headers: dict[str, str]) -> Path:
    path = directory / "web.yml"
    path.write_text(
        yaml.safe_dump({"basic_auth_users": users, "http_server_config": {"headers": headers}})
    )
    return path


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[TestClient, WebSecurity]]:
    security = WebSecurity.from_file(
        _config(tmp_path, {"prometheus": bcrypt_hash("scrape-pw")}, HEADERS)
    )
    app = create_app(Settings(token=TOKEN), clock=FakeClock(), security=security)
    with TestClient(app) as client:
        yield client, security


def _has_headers(response: Any) -> None:
    for name, value in HEADERS.items():
        assert response.headers.get(name) == value, (response.request.url, name)


def test_every_read_needs_basic_auth_and_says_so(secured: tuple[TestClient, WebSecurity]) -> None:
    client, _ = secured
    for path in READS:
        for auth in (None, ("prometheus", "wrong"), ("nobody", "scrape-pw")):
            response = client.get(path, auth=auth)
            assert response.status_code == 401, (path, auth)
            assert response.headers["www-authenticate"].startswith('Basic realm="ampscope"')
            assert response.json()["error"] == "unauthorized"
            _has_headers(response)
    for path in READS[:-1]:
        response = client.get(path, auth=("prometheus", "scrape-pw"))
        assert response.status_code == 200, path
        _has_headers(response)
    missing = client.get("/api/v1/runs/x/health", auth=("prometheus", "scrape-pw"))
    assert missing.status_code == 404
    _has_headers(missing)


def test_healthz_is_open_and_says_nothing_of_runs(
    secured: tuple[TestClient, WebSecurity],
) -> None:
    client, _ = secured
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    _has_headers(response)


def test_ingest_and_heartbeat_take_the_token_not_a_password(
    secured: tuple[TestClient, WebSecurity],
) -> None:
    client, _ = secured
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    accepted = client.post(INGEST_PATH, content=body(record(1)), headers=bearer)
    assert accepted.status_code == 200
    _has_headers(accepted)
    refused = client.post(INGEST_PATH, content=body(record(2)), auth=("prometheus", "scrape-pw"))
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == 'Bearer realm="ampscope"'
    _has_headers(refused)
    beat = client.post(HEARTBEAT_PATH, content=b"{}", headers={"Authorization": "Bearer nope"})
    assert beat.status_code == 401
    assert 'error="invalid_token"' in beat.headers["www-authenticate"]
    metrics = client.get("/metrics", auth=("prometheus", "scrape-pw")).text
    assert 'ampscope_exporter_ingest_rejections_total{reason="token_missing"} 1.0' in metrics
    assert 'ampscope_exporter_ingest_rejections_total{reason="token_wrong"} 1.0' in metrics


def test_a_verified_password_is_cached_a_wrong_one_is_not(
    secured: tuple[TestClient, WebSecurity],
) -> None:
    client, security = secured
    for _ in range(5):
        assert client.get("/metrics", auth=("prometheus", "scrape-pw")).status_code == 200
    assert security.verifier.bcrypt_calls == 1
    for _ in range(3):
        assert client.get("/metrics", auth=("prometheus", "nope")).status_code == 401
    assert security.verifier.bcrypt_calls == 4
    assert "scrape-pw" not in repr(security.verifier._cache), "keys are hashes"


def test_reload_swaps_users_and_headers_and_keeps_the_old_on_error(
    secured: tuple[TestClient, WebSecurity], caplog: pytest.LogCaptureFixture
) -> None:
    client, security = secured
    _config(security.path.parent, {"grafana": bcrypt_hash("new-pw")}, {"X-Frame-Options": "deny"})
    assert security.changed()
    assert security.reload()
    assert client.get("/metrics", auth=("prometheus", "scrape-pw")).status_code == 401
    response = client.get("/metrics", auth=("grafana", "new-pw"))
    assert response.status_code == 200
    assert "content-security-policy" not in response.headers
    security.path.write_text("basic_auth_users: {grafana: plain}\n")
    caplog.set_level(logging.ERROR, logger="ampscope")
    assert security.changed()
    assert not security.reload()
    assert "basic_auth_users.grafana" in caplog.text
    assert not security.changed(), "an invalid file is reported once, not at every poll"
    assert client.get("/metrics", auth=("grafana", "new-pw")).status_code == 200


def test_a_change_landing_after_the_read_is_reloaded_at_the_next_poll(
    secured: tuple[TestClient, WebSecurity], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation writes the file again while a reload reads it: what was applied is the
    first change, and the second must show as a change, not be taken as applied."""
    client, security = secured
    real_load = security_module.load

    def read_then_changed(path: Path) -> Any:
        config = real_load(path)
        _config(path.parent, {"grafana": bcrypt_hash("newest")}, {"X-Frame-Options": "sameorigin"})
        monkeypatch.setattr(security_module, "load", real_load)  # one change only
        return config

    _config(security.path.parent, {"grafana": bcrypt_hash("new-pw")}, {"X-Frame-Options": "deny"})
    monkeypatch.setattr(security_module, "load", read_then_changed)
    assert security.reload()
    assert client.get("/metrics", auth=("grafana", "new-pw")).status_code == 200
    assert security.changed(), "the change after the read was taken as applied"
    assert security.reload()
    response = client.get("/metrics", auth=("grafana", "newest"))
    assert (response.status_code, response.headers["x-frame-options"]) == (200, "sameorigin")
    assert not security.changed()


def test_a_change_landing_while_starting_is_reloaded_at_the_first_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = security_module.load
    path = _config(tmp_path, {"prometheus": bcrypt_hash("pw")}, HEADERS)

    def read_then_changed(read: Path) -> Any:
        config = real_load(read)
        _config(tmp_path, {"prometheus": bcrypt_hash("rotated")}, HEADERS)
        return config

    monkeypatch.setattr(security_module, "load", read_then_changed)
    security = WebSecurity.from_file(path)
    monkeypatch.setattr(security_module, "load", real_load)
    assert security.changed()
    assert security.reload()
    assert not security.changed()


def test_a_certificate_rotated_while_it_is_loaded_is_loaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path / "pki")
    path = tmp_path / "web.yml"
    tls = {"cert_file": "pki/server.crt", "key_file": "pki/server.key"}
    path.write_text(yaml.safe_dump({"tls_server_config": tls}))
    security = WebSecurity.from_file(path)
    real_build = security_module.build_context

    def built_then_rotated(config: Any) -> Any:
        context = real_build(config)
        make_leaf(pki.directory, "server", pki.ca, "DNS:localhost,IP:127.0.0.1")
        monkeypatch.setattr(security_module, "build_context", real_build)
        return context

    headers = {"http_server_config": {"headers": {"X-Frame-Options": "deny"}}}
    path.write_text(yaml.safe_dump({"tls_server_config": tls, **headers}))
    monkeypatch.setattr(security_module, "build_context", built_then_rotated)
    assert security.reload()
    assert security.changed(), "the certificate rotated after it was loaded"
    assert security.reload()
    assert not security.changed()


def test_no_users_leaves_reads_open(tmp_path: Path) -> None:
    security = WebSecurity.from_file(_config(tmp_path, {}, {"X-Content-Type-Options": "nosniff"}))
    with TestClient(create_app(Settings(), security=security)) as client:
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Basic cHJvbTpwdzpjb2xvbg==", ("prom", "pw:colon")),
        ("basic cHJvbTo=", ("prom", "")),
        ("Basic !!!", None),
        ("Basic cHJvbQ==", None),  # no colon
        ("Bearer cHJvbTpwdw==", None),
        (None, None),
    ],
)
def test_parse_basic(header: str | None, expected: tuple[str, str] | None) -> None:
    assert parse_basic(header) == expected


def test_bcrypt_runs_one_at_a_time_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = bcrypt_hash("right", cost=8)
    users = {"u": hashed}
    verifier = BasicAuthVerifier()
    running, most, lock = 0, 0, threading.Lock()
    real_check = basic_auth._check

    def counting_check(password: bytes, stored: bytes) -> bool:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            return real_check(password, stored)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(basic_auth, "_check", counting_check)

    async def scenario() -> tuple[list[bool], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        results = await asyncio.gather(*(verifier.verify(users, "u", f"w{i}") for i in range(8)))
        task.cancel()
        return [*results, await verifier.verify(users, "u", "right")], ticks

    results, ticks = asyncio.run(asyncio.wait_for(scenario(), 60))
    verifier.close()
    assert results == [False] * 8 + [True]
    # The loop kept running while bcrypt worked: the ticker got turns in between.
    assert ticks > 8
    assert most == 1
