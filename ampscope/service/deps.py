"""Request dependencies: the app's state, typed, as ``Annotated`` aliases for routes.

Everything lives on ``app.state`` (set up by ``create_app``'s lifespan), so tests
inject their own settings, store or clock through ``create_app`` or
``app.dependency_overrides``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from ampscope.service.errors import ApiError
from ampscope.service.settings import Settings
from ampscope.service.stats import IngestStats
from ampscope.service.store import Store

Clock = Callable[[], float]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_stats(request: Request) -> IngestStats:
    stats: IngestStats = request.app.state.stats
    return stats


def get_clock(request: Request) -> Clock:
    clock: Clock = request.app.state.clock
    return clock


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
StatsDep = Annotated[IngestStats, Depends(get_stats)]
ClockDep = Annotated[Clock, Depends(get_clock)]


def require_token(request: Request, settings: SettingsDep, stats: StatsDep) -> None:
    """Check ``Authorization: Bearer <token>`` when a token is configured (constant time).

    Raises:
        ApiError: 401 when the header is missing, malformed or wrong.
    """
    if settings.token is None:
        return
    expected = settings.token.get_secret_value().encode()
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        stats.rejected("unauthorized")
        raise ApiError(
            401,
            "unauthorized",
            "ingest needs 'Authorization: Bearer <token>' with the exporter's token "
            "(AMPSCOPE_TOKEN on the ranks)",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authorized = Annotated[None, Depends(require_token)]
