"""Reading a request body without trusting its size."""

from __future__ import annotations

from fastapi import Request

from ampscope.service.errors import ApiError


def _too_large(limit: int, seen: str) -> ApiError:
    return ApiError(
        413,
        "too_large",
        f"request body ({seen}) exceeds max_body_bytes={limit}; send fewer records per batch",
        limit="max_body_bytes",
        value=limit,
    )


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before a byte is read; a body
    without one (chunked) or lying about it is refused as soon as the bytes read pass
    the limit, so memory stays bounded by ``limit`` plus one chunk.

    Raises:
        ApiError: 413 when too large, 400 for an unparseable ``Content-Length``.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "malformed", "Content-Length is not an integer") from None
        if size > limit:
            raise _too_large(limit, f"Content-Length {size}")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(limit, "while reading")
        chunks.append(chunk)
    return b"".join(chunks)
