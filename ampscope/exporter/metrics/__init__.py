"""Prometheus exposition: the metric catalogue (data, defined once), the collector over the
store, and the ``/metrics`` bytes."""
