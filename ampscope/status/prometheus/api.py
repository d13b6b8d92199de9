"""``/api/v1/query`` of one Prometheus-compatible server (Prometheus, VictoriaMetrics, a
Thanos or Mimir query frontend), with the standard library only: every answer's shape is
checked (``ampscope.status.shapes``) and the credentials stay with their host
(``ampscope.status.transport``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ampscope.status import shapes
from ampscope.status.transport import open_url


class QueryError(Exception):
    """Prometheus did not answer, or answered with an error: ``code`` is the exit status."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class PrometheusClient:
    """``/api/v1/query`` of one Prometheus-compatible server.

    Args:
        url: Its base URL (a Thanos or Mimir frontend: the path before ``/api/v1``).
        authorization: The ``Authorization`` header (``Bearer …`` or ``Basic …``), read from
            a file or the environment by the caller, never from argv.
        context: TLS context for ``https://``.
    """

    def __init__(self, url: str, authorization: str | None = None, context: Any = None) -> None:
        self.url = url.rstrip("/")
        self.authorization = authorization
        self.context = context

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` at ``at``, its shape checked.

        Raises:
            QueryError: no answer, an HTTP error, or an error answer.
            shapes.Malformed: an answer that is not JSON, or not an instant vector's JSON.
        """
        body = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"}).encode()
        where = f"{self.url}/api/v1/query"
        request = urllib.request.Request(where, data=body, method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        try:
            with open_url(
                request, timeout=10.0, context=self.context, authorization=self.authorization
            ) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise QueryError(f"{self.url} refused the query (HTTP {exc.code})", 5) from None
            detail = exc.read(2048).decode("utf-8", "replace")
            raise QueryError(f"{self.url} answered HTTP {exc.code}: {detail}", 3) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise QueryError(f"no Prometheus answers at {self.url} ({reason})", 3) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            start = raw[:40].decode("utf-8", "replace")
            raise shapes.Malformed(where, f"not JSON (it begins {start!r})") from None
        shapes.check(answer, shapes.QUERY_ANSWER, where)
        if answer["status"] != "success":
            raise QueryError(f"{self.url}: {answer.get('error', answer['status'])}", 3)
        shapes.check(answer.get("data"), shapes.VECTOR, where, at="data")
        return list(answer["data"]["result"])
