"""What a training loop calls: the fp16 scalers, the bf16/fp32 watch, and what they share.

- ``base.py``: the front-end every kind shares (attach, telemetry, outputs, origin tracking).
- ``scaler_mixin.py``: the one mixin that turns torch's scalers into instrumented ones.
- ``scalers.py``: ``ampscope.GradScaler`` and ``ampscope.ShardedGradScaler``.
- ``watch.py``: ``ampscope.GradWatch`` for runs without a loss scaler (observe, skip, raise).
- ``stop.py``: :class:`NonFiniteGradientsError`, the same words on every rank.
"""
