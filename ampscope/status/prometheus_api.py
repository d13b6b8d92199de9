"""``/api/v1/query`` of one Prometheus-compatible server (Prometheus, VictoriaMetrics, a
Thanos or Mimir query frontend), with the standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


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
        """The instant vector of ``promql`` at ``at``. Raises ``QueryError``."""
        body = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"}).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=body, method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        if self.authorization is not None:
            request.add_header("Authorization", self.authorization)
        try:
            with urllib.request.urlopen(request, timeout=10.0, context=self.context) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise QueryError(f"{self.url} refused the query (HTTP {exc.code})", 5) from None
            detail = exc.read(2048).decode("utf-8", "replace")
            raise QueryError(f"{self.url} answered HTTP {exc.code}: {detail}", 3) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise QueryError(f"no Prometheus answers at {self.url} ({reason})", 3) from None
        if answer.get("status") != "success" or answer["data"]["resultType"] != "vector":
            raise QueryError(f"{self.url}: {answer.get('error', 'not an instant vector')}", 3)
        return list(answer["data"]["result"])
