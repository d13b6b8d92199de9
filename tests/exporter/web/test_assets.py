"""The web view's files are package data, served from the package, with their licences."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from ampscope.exporter.web import STATIC


def test_pages_and_docs_reference_only_shipped_assets(client: TestClient) -> None:
    for page in ("/", "/run?id=x", "/docs"):
        response = client.get(page)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        refs = re.findall(r'(?:src|href)="([^"]+)"', response.text)
        assert refs, page
        for ref in refs:
            if ref.startswith("data:") or ref in {"./", "docs", "metrics"}:
                continue
            assert "//" not in ref, (page, ref)  # no other host, not even a CDN
            path = ref if ref.startswith("/") else "/" + ref
            assert client.get(path).status_code == 200, (page, ref)
    # FastAPI's own /redoc loads its script from a CDN: not served.
    assert client.get("/redoc").status_code == 404


def test_vendored_libraries_ship_with_their_licences() -> None:
    vendor = STATIC / "vendor"
    assert (vendor / "uplot" / "LICENSE").read_text().startswith("The MIT License")
    assert "Apache License" in (vendor / "swagger-ui" / "LICENSE").read_text()
    for name in ("uplot/uPlot.iife.min.js", "swagger-ui/swagger-ui-bundle.js"):
        assert (vendor / name).stat().st_size > 10_000
