"""Schemathesis checks of our own, loaded by the fuzz test through SCHEMATHESIS_HOOKS."""

from __future__ import annotations

from typing import Any

import schemathesis

ERROR_FIELDS = {"error", "detail", "limit", "value", "errors"}


@schemathesis.check
def error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error answer, whatever the endpoint, is the documented ErrorBody JSON."""
    if response.status_code < 400:
        return None
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), (
        f"{response.status_code} answered as {response.headers.get('content-type')}"
    )
    body = response.json()
    assert isinstance(body, dict), body
    assert {"error", "detail"} <= set(body) <= ERROR_FIELDS, body
    assert isinstance(body["error"], str), body
    assert isinstance(body["detail"], str), body
    return True
