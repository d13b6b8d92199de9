"""The exporter's app factory: ``create_app(settings)`` wires store, collector and routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CollectorRegistry

from ampscope import __version__
from ampscope.exporter import web
from ampscope.exporter.api.errors import document_errors, install_error_handlers
from ampscope.exporter.api.routes import heartbeat, ingest, metrics, probes, runs, series
from ampscope.exporter.http.body import ByteBudget
from ampscope.exporter.metrics.collector import StoreCollector
from ampscope.exporter.metrics.exposition import Exposition
from ampscope.exporter.security.policy import SecurityMiddleware, WebSecurity, watch
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.exporter.state.refusals import SUMMARY_INTERVAL_S, RefusalLog
from ampscope.reporter.schema import Heartbeat, IngestBatch

log = logging.getLogger("ampscope.exporter")


async def _prune_forever(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    while True:
        await asyncio.sleep(settings.prune_interval_s)
        dropped = app.state.store.prune(
            app.state.clock(), settings.retention_s, settings.finished_retention_s
        )
        if dropped:
            log.info("dropped %d rank(s) silent for over %.0f s", dropped, settings.retention_s)


async def _summarise_refusals_forever(refusals: RefusalLog) -> None:
    # Refusals that stop arriving are still summarised, within an interval.
    while True:
        await asyncio.sleep(SUMMARY_INTERVAL_S / 4)
        refusals.flush()


def _openapi_with_ingest_schema(app: FastAPI) -> dict[str, Any]:
    # The ingest route reads its body by hand (size-capped), so FastAPI cannot derive the
    # IngestBatch schema from a parameter; add it to the components its route refers to.
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (IngestBatch, Heartbeat):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in body.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = body
        document_errors(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def _build_state(app: FastAPI, settings: Settings, clock: Callable[[], float]) -> None:
    store = settings.store()
    # Created with the app, not here: the server protocol counts into it from the start.
    stats: IngestStats = app.state.stats
    # One registry per app, never prometheus_client's global one: two apps in one process
    # (tests) must not see each other's series.
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(
        store,
        stats,
        clock,
        settings.stale_after_s,
        settings.stall_after_s,
        fp8_window_s=settings.spike_verdict_window_s,
    )
    registry.register(collector)
    app.state.store = store
    app.state.registry = registry
    app.state.exposition = Exposition(store, collector, clock, settings.stale_after_s)


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.time,
    security: WebSecurity | None = None,
) -> FastAPI:
    """Build the exporter app.

    Its lifespan creates the store, the ingest counters and a per-app Prometheus
    registry on ``app.state`` at start-up, and runs a background task that drops ranks
    silent for longer than ``settings.retention_s`` every ``prune_interval_s``. Requests
    need the lifespan to have run: use ``with TestClient(app)`` in tests.

    Args:
        settings: Limits, thresholds and the ingest token.
        clock: Current Unix time; tests pass a fake one to age ranks without sleeping.
        security: The web config in force (``--web-config-file``): its headers go on every
            response and its basic-auth users guard every read. The lifespan re-reads it
            when it changes and on SIGHUP. ``None``: no headers, reads open.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _build_state(app, settings, clock)
        tasks = [asyncio.create_task(_prune_forever(app))]
        tasks.append(asyncio.create_task(_summarise_refusals_forever(refusals)))
        if security is not None:
            tasks.append(asyncio.create_task(watch(security)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if security is not None:
                security.verifier.close()
            refusals.flush(final=True)

    app = FastAPI(
        title="ampscope exporter",
        version=__version__,
        summary="Loss-scaler telemetry of every rank on this node: Prometheus metrics, "
        "a JSON API and health verdicts.",
        lifespan=lifespan,
        # /docs is served from vendored assets by `web`; FastAPI's own pages use a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.clock = clock
    # Refused requests are summarised in the log by reason, at most once a minute.
    refusals = RefusalLog(log, clock=clock)
    app.state.stats = IngestStats(refusals)
    app.state.inflight = ByteBudget(settings.max_inflight_bytes)
    app.openapi = lambda: _openapi_with_ingest_schema(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    for module in (ingest, heartbeat, metrics, runs, series, probes):
        app.include_router(module.router)
    web.install(app)
    if security is not None:
        app.add_middleware(SecurityMiddleware, security=security)
    app.state.security = security
    return app
