"""The PromQL of ``ampscope devices`` and a Prometheus client that checks every answer's shape.

Reads the raw series (``ampscope_device_offences_total`` and
``ampscope_device_last_offence_timestamp_seconds``), so it works where no recording rule is
loaded, and DCGM-exporter's error fields that are not zero, kept for the GPUs found. Three
instant queries in all, in parallel. Works against Prometheus, VictoriaMetrics and Thanos or
Mimir query frontends (``/api/v1/query`` only).
"""

from __future__ import annotations

import json
import math
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EXIT_QUERY_FAILED = 3
EXIT_UNAUTHORIZED = 5
EXIT_TLS_REFUSED = 6

DCGM_FIELDS = (
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
)
"""DCGM-exporter fields that say a GPU is failing: the last XID error, double-bit ECC errors
(volatile and aggregate) and row remapping (rows remapped for uncorrectable errors, a failed
remap). Read for the devices found, by their ``UUID`` label."""

DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
"""A PromQL duration: ``30d``, ``12h``, ``1d12h``."""


class QueryError(Exception):
    """Prometheus did not answer, refused us, or answered something else than asked:
    ``code`` is the exit status (3, 5 or 6)."""

    def __init__(self, reason: str, code: int = EXIT_QUERY_FAILED) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Sample:
    """One sample of an instant vector: its labels and value."""

    labels: dict[str, str]
    value: float


def offences_query(since: str) -> str:
    """Offences per run, device, node and kind: the highest count within ``since``."""
    return (
        f"max by (device, node, run, kind) (max_over_time(ampscope_device_offences_total[{since}]))"
    )


def last_offence_query(since: str) -> str:
    """Per run, device and node: the time of the newest offence within ``since``."""
    return (
        "max by (device, node, run) "
        f"(max_over_time(ampscope_device_last_offence_timestamp_seconds[{since}]))"
    )


def dcgm_query() -> str:
    """Every GPU's ``DCGM_FIELDS`` that are not zero now, labelled with ``field``: one
    selector, whatever the number of GPUs (VictoriaMetrics refuses queries over 16 KiB, so
    the UUIDs are matched here, not in the query). Current values: the ECC and remapping
    fields are cumulative, and the XID field holds the last XID until the driver resets it."""
    names = "|".join(DCGM_FIELDS)
    return f'label_replace({{__name__=~"{names}"}}, "field", "$1", "__name__", "(.+)") > 0'


def _samples(url: str, answer: Any) -> list[Sample]:
    """The samples of an instant-vector answer. Raises ``QueryError`` naming what is wrong."""
    if not isinstance(answer, dict):
        raise QueryError(f"{url} answered a JSON {type(answer).__name__}, not an object")
    if answer.get("status") != "success":
        error = answer.get("error") or f"status {answer.get('status')!r}"
        raise QueryError(f"{url} answered an error: {str(error)[:300]}")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise QueryError(f"{url} answered {kind!r} data, not an instant vector")
    result = data.get("result")
    if not isinstance(result, list):
        raise QueryError(f"{url} answered a vector whose result is not a list")
    samples = []
    for item in result:
        metric = item.get("metric") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        if not (
            isinstance(metric, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items())
            and isinstance(value, list)
            and len(value) == 2
            and isinstance(value[1], str)
        ):
            raise QueryError(f"{url} answered a malformed sample: {json.dumps(item)[:200]}")
        try:
            number = float(value[1])
        except ValueError:
            raise QueryError(f"{url} answered a sample value {value[1][:50]!r}") from None
        samples.append(Sample(metric, number))
    return samples


def require(samples: list[Sample], url: str, labels: Sequence[str]) -> list[Sample]:
    """``samples``, once each has ``labels`` and a finite value. Raises ``QueryError``."""
    for sample in samples:
        missing = [name for name in labels if name not in sample.labels]
        if missing or not math.isfinite(sample.value):
            raise QueryError(
                f"{url} answered a sample without {', '.join(missing)}"
                if missing
                else f"{url} answered a sample whose value is {sample.value}"
            )
    return samples


class Prometheus:
    """``/api/v1/query`` of one Prometheus-compatible server.

    Args:
        url: Its base URL (a Thanos or Mimir frontend: the path before ``/api/v1``).
        authorization: The ``Authorization`` header (``Bearer …`` or ``Basic …``).
        context: TLS context for ``https://``.
        timeout: Seconds for each query.
    """

    def __init__(
        self,
        url: str,
        authorization: str | None = None,
        context: ssl.SSLContext | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.authorization = authorization
        self.context = context
        self.timeout = timeout

    def query(self, promql: str, at: float) -> list[Sample]:
        """The instant vector of ``promql`` at Unix time ``at``. Raises ``QueryError``."""
        body = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"}).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=body, method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        if self.authorization is not None:
            request.add_header("Authorization", self.authorization)
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout, context=self.context
            ) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise QueryError(
                    f"{self.url} refused the query (HTTP {exc.code})", EXIT_UNAUTHORIZED
                ) from None
            detail = " ".join(exc.read(2048).decode("utf-8", "replace").split())
            raise QueryError(f"{self.url} answered HTTP {exc.code}: {detail[:300]}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, ssl.SSLError):
                raise QueryError(f"{self.url}: TLS failed ({reason})", EXIT_TLS_REFUSED) from None
            raise QueryError(f"no Prometheus answers at {self.url} ({reason})") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            start = " ".join(raw[:80].decode("utf-8", "replace").split())
            raise QueryError(f"{self.url} answered something else than JSON: {start!r}") from None
        return _samples(self.url, answer)
