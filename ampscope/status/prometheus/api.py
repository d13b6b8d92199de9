"""``/api/v1/query`` of one Prometheus-compatible server (Prometheus, VictoriaMetrics, a
Thanos or Mimir query frontend), through the one HTTP client (``ampscope.status.transport``:
credentials that stay with their host, TLS, exit codes); every answer's shape is checked
(``ampscope.status.shapes``). Used by ``ampscope status --prometheus`` and
``ampscope devices``. Standard library only."""

from __future__ import annotations

import ssl
from typing import Any

from ampscope.status import shapes
from ampscope.status.transport import Endpoint, Refused, Unreachable, request_json


class QueryError(Exception):
    """Prometheus did not answer, refused us, or answered with an error: ``code`` is the
    exit status (3 no answer or an error, 5 refused credentials, 6 TLS failed)."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class PrometheusClient:
    """``/api/v1/query`` of one Prometheus-compatible server.

    Args:
        endpoint: Its base URL (a Thanos or Mimir frontend: the path before ``/api/v1``),
            the ``Authorization`` header (``Bearer …`` or ``Basic …``, read from a file or
            the environment by the caller, never from argv) and the TLS context; or the
            base URL alone, with those two as the next arguments.
        authorization: With a URL: the ``Authorization`` header.
        context: With a URL: the TLS context for ``https://``.
        timeout: Seconds for each query.
    """

    def __init__(
        self,
        endpoint: Endpoint | str,
        authorization: str | None = None,
        context: ssl.SSLContext | None = None,
        *,
        timeout: float = 10.0,
    ) -> None:
        if isinstance(endpoint, str):
            endpoint = Endpoint(endpoint, authorization, context)
        self.endpoint = Endpoint(
            endpoint.url.rstrip("/"),
            endpoint.authorization,
            endpoint.context,
            endpoint.client_cert,
        )
        self.timeout = timeout

    @property
    def url(self) -> str:
        """The base URL."""
        return self.endpoint.url

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header sent, if any."""
        return self.endpoint.authorization

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` at Unix time ``at``, its shape checked (values
        may be ``NaN`` or ``±Inf``: ``shapes.check_finite`` where a number must be one).
        One ``POST``; blocks until the answer or ``timeout``.

        Raises:
            QueryError: no answer, an HTTP error, refused credentials or TLS, an error answer.
            shapes.Malformed: an answer that is not JSON, or not an instant vector's JSON.
        """
        where = f"{self.url}/api/v1/query"
        form = {"query": promql, "time": f"{at:.3f}"}
        try:
            answer = request_json(
                self.endpoint, "/api/v1/query", form=form, timeout=self.timeout, what="Prometheus"
            )
        except (Unreachable, Refused) as exc:
            raise QueryError(str(exc), exc.code) from None
        shapes.check(answer, shapes.QUERY_ANSWER, where)
        if answer["status"] != "success":
            error = str(answer.get("error", answer["status"]))[:300]
            raise QueryError(f"{self.url} answered an error: {error}", 3)
        shapes.check(answer.get("data"), shapes.VECTOR, where, at="data")
        return list(answer["data"]["result"])
