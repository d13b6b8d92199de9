"""Request dependencies: the app's state, typed, as ``Annotated`` aliases for routes.

Everything lives on ``app.state`` (set up by ``create_app``'s lifespan), so tests
inject their own settings, store or clock through ``create_app`` or
``app.dependency_overrides``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

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


_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="The exporter's token (--token-file or AMPSCOPE_TOKEN), which ranks send "
    "from AMPSCOPE_TOKEN. Needed by ingest only, and only when the exporter has one.",
)
"""Declares the bearer scheme in the OpenAPI; the check itself is ``require_token``'s."""


def require_token(
    settings: SettingsDep,
    stats: StatsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> None:
    """Check ``Authorization: Bearer <token>`` when a token is configured (constant time).

    Raises:
        ApiError: 401 when the header is missing, malformed or wrong.
    """
    if settings.token is None:
        return
    expected = settings.token.get_secret_value().encode()
    given = b"" if credentials is None else credentials.credentials.strip().encode()
    if credentials is None or not hmac.compare_digest(given, expected):
        stats.rejected("unauthorized")
        raise ApiError(
            401,
            "unauthorized",
            "ingest needs 'Authorization: Bearer <token>' with the exporter's token "
            "(AMPSCOPE_TOKEN on the ranks)",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authorized = Annotated[None, Depends(require_token)]
