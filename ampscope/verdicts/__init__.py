"""The health verdicts: every rule once, as pure functions over a neutral view of a run's ranks.

Imported by the exporter's health (``ampscope.exporter.health``, over its store) and by
``ampscope status`` (over exporters' answers or Prometheus series) alike; imports neither
torch nor the server stack, only pydantic and the standard library
(``tests/test_layering.py``).

- ``verdict``: the ``Verdict`` model, statuses and their order, the rules in report order.
- ``ranks``: rank states, "is this rank a scaler", ``RankFacts``.
- ``thresholds``: every rule's thresholds, validated once.
- ``scale``: ``scale_collapse``, ``scale_desync`` (why aligned steps: its docstring).
- ``nonfinite``: ``skip_storm``, ``inf_hotspot``, ``nonfinite_update_applied``.
- ``liveness``: ``lost_rank``, ``missing_rank``, ``stalled_rank``, ``stopped_rank``.
- ``failures``: ``rank_failed`` (ranks whose training ended on an exception).
- ``spikes``: ``loss_spike``, ``grad_norm_spike``, ``origin_outlier``.
- ``replicas``: ``replica_divergence`` (replicas whose parameters stopped agreeing).
- ``fp8``: ``fp8_amax_spike``, ``fp8_underflow``, ``fp8_nonfinite_amax`` over FP8 layers'
  series, and their thresholds (``Fp8Rule``).
- ``rollup``: a run's status, state and state counts from its verdicts and ranks.
"""
