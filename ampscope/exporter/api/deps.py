"""Request dependencies: the app's state, typed, as ``Annotated`` aliases for routes.

Everything lives on ``app.state`` (set up by ``create_app``'s lifespan), so tests
inject their own settings, store or clock through ``create_app``.

Every dependency here is ``async def`` although none awaits: FastAPI runs a plain ``def``
dependency in its thread pool, and those hand-offs (five per ingest request) cost more
than the work they wrap. None of them blocks: attribute reads and one constant-time
compare.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ampscope.exporter.api.errors import ApiError
from ampscope.exporter.http.body import BodyLimit, received_body
from ampscope.exporter.settings import Settings
from ampscope.exporter.state.ingest_counters import IngestStats
from ampscope.exporter.state.store import Store

Clock = Callable[[], float]
REALM = "ampscope"


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency giving ``request.app.state.<name>``, which the app factory sets."""

    async def dependency(request: Request) -> Any:
        return getattr(request.app.state, name)

    dependency.__name__ = f"get_{name}"
    return dependency


SettingsDep = Annotated[Settings, Depends(_app_state("settings"))]
StoreDep = Annotated[Store, Depends(_app_state("store"))]
StatsDep = Annotated[IngestStats, Depends(_app_state("stats"))]
ClockDep = Annotated[Clock, Depends(_app_state("clock"))]


_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="The exporter's token (--token-file or AMPSCOPE_TOKEN), which ranks send "
    "from AMPSCOPE_TOKEN. Needed by ingest only, and only when the exporter has one.",
)
"""Declares the bearer scheme in the OpenAPI; the check itself is ``require_token``'s."""


async def require_token(
    settings: SettingsDep,
    stats: StatsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> None:
    """Check ``Authorization: Bearer <token>`` when a token is configured (constant time).

    A missing token and a wrong one are counted under their own reasons (``token_missing``,
    ``token_wrong``): the first is a misconfigured rank, the second maybe an attacker.

    Raises:
        ApiError: 401 with an RFC 6750 ``WWW-Authenticate: Bearer`` challenge.
    """
    if settings.token is None:
        return
    expected = settings.token.get_secret_value().encode()
    if credentials is None:
        stats.rejected("token_missing")
        raise ApiError(
            401,
            "unauthorized",
            "ingest needs 'Authorization: Bearer <token>' with the exporter's token "
            "(AMPSCOPE_TOKEN or AMPSCOPE_TOKEN_FILE on the ranks)",
            headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'},
        )
    if not hmac.compare_digest(credentials.credentials.strip().encode(), expected):
        stats.rejected("token_wrong")
        raise ApiError(
            401,
            "unauthorized",
            "the bearer token is not the exporter's (AMPSCOPE_TOKEN or AMPSCOPE_TOKEN_FILE on "
            "the ranks must hold what --token-file holds)",
            headers={
                "WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token", '
                'error_description="wrong token"'
            },
        )


Authorized = Annotated[None, Depends(require_token)]


@dataclass(frozen=True)
class Delivery:
    """What a route that takes a rank's delivery (a batch of records, a heartbeat) works
    with, once the token is checked: the request, the app's settings, store, ingest
    counters and clock."""

    request: Request
    settings: Settings
    store: Store
    stats: IngestStats
    clock: Clock

    def body(self, limit: BodyLimit, route: str) -> AbstractAsyncContextManager[bytes]:
        """The request body within ``limit``, the exporter's in-flight byte budget and its
        ``body_timeout_s``, refusals counted (``received_body``)."""
        return received_body(
            self.request,
            limit=limit,
            budget=self.request.app.state.inflight,
            timeout_s=self.settings.body_timeout_s,
            stats=self.stats,
            route=route,
        )


async def _delivery(
    request: Request,
    _: Authorized,
    settings: SettingsDep,
    store: StoreDep,
    stats: StatsDep,
    clock: ClockDep,
) -> Delivery:
    return Delivery(request, settings, store, stats, clock)


DeliveryDep = Annotated[Delivery, Depends(_delivery)]
