"""The API's error answers: one exception type, one JSON shape (``ErrorBody``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ampscope.service.models import ErrorBody


class ApiError(Exception):
    """Raised by routes and dependencies; answered as ``ErrorBody`` JSON.

    Args:
        status: HTTP status code.
        error: Machine-readable reason (``ErrorBody.error``).
        detail: Human-readable explanation.
        headers: Extra response headers (``WWW-Authenticate``, ``Retry-After``).
        extra: ``limit``, ``value`` or ``errors`` fields of ``ErrorBody``.
    """

    def __init__(
        self,
        status: int,
        error: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.body = ErrorBody(error=error, detail=detail, **extra)
        self.headers = headers


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(
        exc.body.model_dump(exclude_none=True), status_code=exc.status, headers=exc.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``ApiError`` as JSON on ``app``."""
    app.add_exception_handler(ApiError, _handle)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting ``ErrorBody`` for ``statuses``."""
    return {status: {"model": ErrorBody} for status in statuses}
