"""One iteration, captured on the training thread at the least cost.

- ``scaler.py``: what a scaler's iteration saw (found-inf per device, scale, stats), kept on
  the device and copied to the host once, off the hot path.
- ``watch.py``: the same for a :class:`~ampscope.GradWatch` iteration.
- ``registry.py``: what both know across iterations: each optimizer, and the step parts
  they share (optimizer slots, device names, setups).
- ``layout.py``: the one layout of a step's values, with its encoders and its decoder.
- ``pending.py``: a captured step on its way to the telemetry thread, and its host copy.
"""
