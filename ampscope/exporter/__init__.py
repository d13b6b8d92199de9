"""The per-node exporter: ingest, store, Prometheus collector, JSON API, health verdicts."""
