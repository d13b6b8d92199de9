"""Reading a request body without trusting its size, its pace or its sender."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ampscope.exporter.api.errors import ApiError, invalid_body
from ampscope.exporter.http.parse import MAX_JSON_DEPTH, TooDeep
from ampscope.exporter.state.ingest_counters import IngestStats

log = logging.getLogger("ampscope.exporter")

BUSY_RETRY_AFTER_S = 1
"""Retry-After of a 429 for a full in-flight budget: uploads finish in milliseconds."""


def openapi_body(schema: str) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body here instead of letting
    FastAPI parse it: OpenAPI is told the body is required and holds ``schema`` (a
    component the app registers)."""
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    return {"requestBody": {"required": True, "content": content}}


class ClientGone(Exception):
    """The client closed the connection before its body was complete."""

    def __init__(self, received: int) -> None:
        super().__init__(f"client disconnected after {received} body bytes")
        self.received = received


class ByteBudget:
    """Bytes of request bodies held at once, over all requests (thread-safe, O(1))."""

    def __init__(self, capacity: int) -> None:
        """Args: capacity: bytes that may be held at once (``max_inflight_bytes``)."""
        self.capacity = capacity
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def take(self, size: int) -> bool:
        """Reserve ``size`` bytes; False (reserving nothing) when they do not fit."""
        with self._lock:
            if self._held + size > self.capacity:
                return False
            self._held += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self._held -= size


@dataclass(frozen=True)
class BodyLimit:
    """How large a route's body may be, and what a 413 tells the sender."""

    bytes: int
    name: str = "max_body_bytes"
    """The setting (or fixed bound) named in the 413's ``limit``."""
    hint: str = "send fewer records per batch"


def too_deep(exc: TooDeep) -> ApiError:
    """The 400 for a body nested deeper than ``MAX_JSON_DEPTH`` (counted as ``malformed``)."""
    return ApiError(400, "malformed", str(exc), limit="max_json_depth", value=MAX_JSON_DEPTH)


Parsed = TypeVar("Parsed")


def parse_counted(
    parse: Callable[[bytes], Parsed], body: bytes, schema: str, stats: IngestStats
) -> Parsed:
    """``parse(body)``, a refusal counted by its reason and raised as the API's answer: 400
    ``malformed`` (not JSON, or nested too deep) or 422 ``invalid`` (``invalid_body``).

    Raises:
        ApiError: the body is not a valid ``schema``.
    """
    try:
        return parse(body)
    except TooDeep as exc:
        stats.rejected("malformed")
        raise too_deep(exc) from None
    except ValidationError as exc:
        answer = invalid_body(exc, schema)
        stats.rejected(answer.body.error)
        raise answer from None


def _too_large(limit: BodyLimit, seen: str) -> ApiError:
    return ApiError(
        413,
        "too_large",
        f"request body ({seen}) exceeds {limit.name}={limit.bytes}; {limit.hint}",
        limit=limit.name,
        value=limit.bytes,
    )


def _busy(budget: ByteBudget) -> ApiError:
    return ApiError(
        429,
        "busy",
        f"the exporter is receiving max_inflight_bytes={budget.capacity} of bodies already; "
        f"retry shortly",
        limit="max_inflight_bytes",
        value=budget.capacity,
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )


@contextlib.asynccontextmanager
async def received_body(
    request: Request,
    *,
    limit: BodyLimit,
    budget: ByteBudget,
    timeout_s: float,
    stats: IngestStats,
    route: str,
) -> AsyncIterator[bytes]:
    """The request body, at most ``limit.bytes`` bytes, held against ``budget`` until exit.

    A declared ``Content-Length`` over the limit is refused before a byte is read, and
    one that does not fit the budget is refused likewise; a body without one (chunked)
    or lying about it is refused as soon as the bytes read pass the limit or the budget,
    so memory stays bounded by ``limit`` plus one chunk per request and by ``budget``
    over all of them. Parse inside the ``async with`` so the budget also covers the
    parsed copy. Each ``ApiError`` raised here is counted in ``stats`` under its code.

    A client that disconnects mid-body (a killed rank: expected in operation) costs one
    warning line naming ``route`` and a ``client_disconnect`` rejection, no traceback.

    Raises:
        ApiError: 413 when too large, 429 when the budget is full, 408 when the body is
            not complete within ``timeout_s`` (answered with ``Connection: close``),
            400 for an unparseable ``Content-Length`` or a client that disconnected (nobody
            reads that answer; uvicorn drops it for a closed connection).
    """
    reserved = 0

    async def read() -> bytes:
        nonlocal reserved
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, "malformed", "Content-Length is not an integer") from None
            if size > limit.bytes:
                raise _too_large(limit, f"Content-Length {size}")
            if not budget.take(size):
                raise _busy(budget)
            reserved = size
        chunks: list[bytes] = []
        received = 0
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit.bytes:
                    raise _too_large(limit, "while reading")
                if received > reserved:
                    if not budget.take(received - reserved):
                        raise _busy(budget)
                    reserved = received
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone(received) from None
        return b"".join(chunks)

    try:
        try:
            body = await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            stats.rejected("body_timeout")
            raise ApiError(
                408,
                "body_timeout",
                f"request body not complete within body_timeout_s={timeout_s:g}",
                limit="body_timeout_s",
                value=timeout_s,
                # The rest of the body may still come: never read it as a next request.
                headers={"Connection": "close"},
            ) from None
        except ApiError as exc:
            stats.rejected(exc.body.error)
            raise
        except ClientGone as exc:
            stats.rejected("client_disconnect")
            client = request.client
            log.warning(
                "%s: client %s disconnected after %d of %s body bytes",
                route,
                f"{client.host}:{client.port}" if client else "?",
                exc.received,
                request.headers.get("content-length", "(chunked)"),
            )
            raise ApiError(400, "client_disconnect", str(exc)) from None
        yield body
    finally:
        budget.give(reserved)
