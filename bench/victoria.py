"""VictoriaMetrics' HTTP API as the at-scale benchmark and its test use it: import a
:class:`~bench.simulated_job.SimulatedJob`'s scrapes, flush, time queries, read the TSDB's
size.

Only the single-node server's documented endpoints: ``/api/v1/import/prometheus`` (text
exposition with timestamps; ``extra_label`` adds the ``job`` and ``instance`` labels a
scrape would), ``/internal/force_flush`` (makes imported samples searchable at once),
``/api/v1/query`` and ``/api/v1/query_range``, ``/api/v1/status/tsdb`` and ``/metrics``.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
from typing import Any

from bench.simulated_job import SimulatedJob

SCRAPE_JOB = "ampscope"
EXPORTER_PORT = 9400


class VictoriaClient:
    """One keep-alive connection to a VictoriaMetrics at ``host:port``."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self.url = f"http://{host}:{port}"
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)

    def close(self) -> None:
        self._conn.close()

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        headers = {"Content-Type": "application/x-www-form-urlencoded"} if method == "POST" else {}
        try:
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
        except http.client.RemoteDisconnected:
            # The server closed the idle keep-alive connection before reading the request.
            self._conn.close()
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
        data = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path} answered {response.status}: {data[:500]!r}")
        return data

    def import_prometheus(self, body: bytes, labels: dict[str, str]) -> None:
        """Import text exposition (samples may carry millisecond timestamps)."""
        query = urllib.parse.urlencode([("extra_label", f"{k}={v}") for k, v in labels.items()])
        self._call("POST", f"/api/v1/import/prometheus?{query}", body)

    def flush(self) -> None:
        """Make every imported sample searchable now (otherwise within about a second)."""
        self._call("GET", "/internal/force_flush")

    def query(self, promql: str, at: float) -> tuple[float, list[dict[str, Any]]]:
        """``(seconds, result)`` of an instant query at ``at``."""
        # nocache: every figure is a cold evaluation, not VictoriaMetrics' result cache.
        form = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}", "nocache": "1"})
        started = time.perf_counter()
        answer = json.loads(self._call("POST", "/api/v1/query", form.encode()))
        return time.perf_counter() - started, answer["data"]["result"]

    def query_range(
        self, promql: str, start: float, end: float, step: float
    ) -> tuple[float, list[dict[str, Any]]]:
        """``(seconds, result)`` of a range query, as a Grafana panel sends it."""
        form = urllib.parse.urlencode(
            {
                "query": promql,
                "start": f"{start:.3f}",
                "end": f"{end:.3f}",
                "step": f"{step:g}s",
                "nocache": "1",
            }
        ).encode()
        started = time.perf_counter()
        answer = json.loads(self._call("POST", "/api/v1/query_range", form))
        return time.perf_counter() - started, answer["data"]["result"]

    def label_values(self, label: str, match: str) -> tuple[float, list[str]]:
        """``(seconds, values)`` of ``label`` over the series ``match`` selects: what
        Grafana's ``label_values(match, label)`` variable query asks."""
        query = urllib.parse.urlencode({"match[]": match})
        started = time.perf_counter()
        answer = json.loads(self._call("GET", f"/api/v1/label/{label}/values?{query}"))
        return time.perf_counter() - started, list(answer["data"])

    def series_count(self, selector: str, start: float, end: float) -> int:
        """Distinct series matching ``selector`` with samples in [start, end]."""
        form = urllib.parse.urlencode(
            {"match[]": selector, "start": f"{start:.0f}", "end": f"{end:.0f}"}
        ).encode()
        return int(json.loads(self._call("POST", "/api/v1/series/count", form))["data"][0])

    def tsdb_status(self) -> dict[str, Any]:
        """``/api/v1/status/tsdb``: the largest metric names by series count, and more."""
        return dict(json.loads(self._call("GET", "/api/v1/status/tsdb?topN=50"))["data"])

    def version(self) -> str:
        """The server's version, from its ``vm_app_version`` self-metric; empty when the
        build does not say."""
        for key in self.metrics():
            if key.startswith("vm_app_version{"):
                found = re.search(r'short_version="([^"]*)"', key) or re.search(
                    r'version="([^"]*)"', key
                )
                if found and found.group(1):
                    return found.group(1)
        return ""

    def metrics(self) -> dict[str, float]:
        """The server's own ``/metrics`` (``name{labels}`` -> value)."""
        values: dict[str, float] = {}
        for line in self._call("GET", "/metrics").decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def load_job(job: SimulatedJob, client: VictoriaClient) -> dict[str, Any]:
    """Import every scrape of ``job`` (newest timed now) and flush.

    Returns:
        samples, exposition bytes, seconds, and the newest scrape's time.
    """
    started = time.perf_counter()
    samples = size = 0
    newest = 0.0
    for index, now, body in job.scrapes():
        labels = {"job": SCRAPE_JOB, "instance": f"{job.node_name(index)}:{EXPORTER_PORT}"}
        client.import_prometheus(body, labels)
        samples += body.count(b"\n")
        size += len(body)
        newest = now
    client.flush()
    return {
        "samples": samples,
        "exposition_bytes": size,
        "seconds": time.perf_counter() - started,
        "newest_scrape": newest,
    }
