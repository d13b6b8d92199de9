"""From a captured iteration to records: the telemetry thread, records, identity, outputs.

- ``pipeline.py``: pending steps → records → history, totals and sinks, on a background thread.
- ``records.py``: a step's host values → :class:`StepRecord`, stage by stage, over
  ``outcome.py`` (what the iteration did), ``totals.py`` (the running totals),
  ``vouching.py`` (cheap checks in place of strict validation), ``shared_parts.py`` (parts
  shared between records) and ``stats_record.py`` (loss, gradient norms, spikes).
- ``identity.py``: who a rank is (run, node, rank, local rank, world size, job).
- ``outputs.py``: where records go (the reporter and sinks).
- ``batches.py``: the batch ids ``note_batch`` takes, as a record carries them.
"""
