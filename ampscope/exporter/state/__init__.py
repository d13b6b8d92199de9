"""What the exporter knows: runs → ranks in one store, each rank's history and lifecycle,
spike windows, the chart columns, and the ingest counters."""
