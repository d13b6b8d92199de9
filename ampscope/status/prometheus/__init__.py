"""``ampscope status --prometheus URL [RUN]``: the whole job read from Prometheus (or
VictoriaMetrics, or a Thanos/Mimir query frontend) through ``/api/v1/query`` only.

``api`` is the HTTP client (``PrometheusClient``, ``QueryError``); ``health`` builds the
answer (ranks and verdicts by the exporter's own rules, ``fetch``); ``ranks`` turns the
per-rank series into rank views and finds the lost ranks; ``fp8`` judges the FP8 rules
from the FP8 gauges.
"""

from ampscope.status.prometheus.health import fetch, health_of, queries

__all__ = ["fetch", "health_of", "queries"]
