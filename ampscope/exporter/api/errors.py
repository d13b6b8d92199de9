"""The API's error answers: one exception type, one JSON shape (``ErrorBody``).

Every error of every endpoint uses it: ``ApiError`` raised by routes, Starlette's
404/405, FastAPI's 422 for bad query or path parameters, unexpected 500s, and the
server's own 400/408/503 (``ampscope.exporter.http.server``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ampscope.exporter.api.models import ErrorBody
from ampscope.exporter.state.store import BatchRefused

MAX_REPORTED_ERRORS = 20
"""422 answers list at most this many violations."""
_MAX_MESSAGE = 200
_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


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


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = _ERROR_CODES.get(exc.status_code, "http_error")
    body = ErrorBody(error=error, detail=f"{exc.detail}: {request.method} {request.url.path}")
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=exc.status_code, headers=exc.headers
    )


def trimmed_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic errors as ``ErrorBody.errors``: location, message, type; bounded."""
    return [
        {"loc": list(e["loc"]), "msg": str(e["msg"])[:_MAX_MESSAGE], "type": e["type"]}
        for e in errors[:MAX_REPORTED_ERRORS]
    ]


def refusal(exc: BatchRefused) -> ApiError:
    """The answer to a batch or heartbeat the store refused (409, 422 or 429)."""
    retry = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return ApiError(
        exc.status, exc.reason, exc.detail, headers=retry, limit=exc.limit, value=exc.value
    )


def invalid_body(exc: ValidationError, schema: str) -> ApiError:
    """The answer to a request body the record schema ``schema`` refused: 400 ``malformed``
    when it is not JSON, else 422 ``invalid`` naming the first violation's location and
    listing the first ``MAX_REPORTED_ERRORS`` of them."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0]
    message = str(first["msg"])[:_MAX_MESSAGE]
    if any(e["type"] == "json_invalid" for e in errors):
        return ApiError(400, "malformed", f"body is not valid JSON: {message}")
    where = ".".join(map(str, first["loc"])) or "body"
    return ApiError(
        422,
        "invalid",
        f"{len(errors)} schema violation(s) of {schema} (schema_version 1); first at {where}: "
        f"{message}",
        errors=trimmed_errors(list(errors)),
    )


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(map(str, first["loc"])) or "request"
    body = ErrorBody(
        error="invalid",
        detail=f"{len(errors)} invalid request parameter(s); first at {where}: "
        f"{str(first['msg'])[:_MAX_MESSAGE]}",
        errors=trimmed_errors(errors),
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=422)


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this answer is sent; the body says no more.
    body = ErrorBody(error="internal", detail="internal error; the exporter's log has details")
    return JSONResponse(body.model_dump(exclude_none=True), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``ApiError``, 404/405, parameter 422s and unexpected 500s as ``ErrorBody``."""
    app.add_exception_handler(ApiError, _handle)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(Exception, _handle_unexpected)


def document_errors(schema: dict[str, Any]) -> None:
    """Make an OpenAPI document say what ``install_error_handlers`` does: every 422 and
    every other error status (``default``) of every operation is an ``ErrorBody``."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault(
        "ErrorBody", ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    )
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            if "422" in answers:
                answers["422"]["content"] = error
            answers["default"] = {"description": "Any other error", "content": error}
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting ``ErrorBody`` for ``statuses``."""
    return {status: {"model": ErrorBody} for status in statuses}
