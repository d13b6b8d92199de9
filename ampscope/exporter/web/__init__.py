"""The exporter's built-in web view and offline API docs.

Pages and their scripts are static files in ``static/`` (shipped as package data), every
third-party asset vendored under ``static/vendor/`` with its licence: nothing is loaded
from another host, so the view and ``/docs`` work on an air-gapped cluster. The pages
read the same JSON API as every other client (``/api/v1/...``); there is no private
channel. ``install(app)`` mounts them; ``create_app`` calls it.

Vendored, unmodified, from npm (``npm pack``): ``uplot@1.6.32`` (MIT; ``dist/uPlot.iife.min.js``,
``dist/uPlot.min.css``) and ``swagger-ui-dist@5.35.0`` (Apache-2.0; the bundle, its CSS, its
favicon, LICENSE, NOTICE and the bundle's third-party licence file). To update one, replace
its files and the versions here and in docs/web-view.md.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
"""Pages, scripts and vendored assets (uPlot, Swagger UI)."""

UI_PREFIX = "/ui"

router = APIRouter(include_in_schema=False)


@router.get("/")
def runs_page() -> FileResponse:
    """The runs page: every run with its ranks, states, step, scale and worst verdict."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/run")
def run_page() -> FileResponse:
    """One run (``/run?id=RUN``): scale per rank, skips, found-inf heatmaps, verdicts."""
    return FileResponse(STATIC / "run.html", media_type="text/html")


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI from the vendored swagger-ui-dist, not FastAPI's default CDN."""
    root = request.scope.get("root_path", "").rstrip("/")
    vendor = f"{root}{UI_PREFIX}/vendor/swagger-ui"
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - API docs",
        swagger_js_url=f"{vendor}/swagger-ui-bundle.js",
        swagger_css_url=f"{vendor}/swagger-ui.css",
        swagger_favicon_url=f"{vendor}/favicon-32x32.png",
        oauth2_redirect_url=None,
        # The default validator badge fetches https://validator.swagger.io for non-local specs.
        swagger_ui_parameters={"validatorUrl": None},
    )


def install(app: FastAPI) -> None:
    """Serve the web view at ``/``, its assets under ``/ui`` and Swagger UI at ``/docs``.

    Contract: ``app`` was built with ``docs_url=None`` and ``redoc_url=None`` (FastAPI's own
    pages load their scripts from a CDN).
    """
    app.include_router(router)
    app.mount(UI_PREFIX, StaticFiles(directory=STATIC), name="ui")
