"""From a captured iteration to records: the telemetry thread, records, identity, outputs.

- ``pipeline.py``: pending steps → records → history, totals and sinks, on a background thread.
- ``records.py``, ``stats_record.py``: a step's host values → :class:`StepRecord`.
- ``identity.py``: who a rank is (run, node, rank, local rank, world size, job).
- ``outputs.py``: where records go (the reporter and sinks).
"""
