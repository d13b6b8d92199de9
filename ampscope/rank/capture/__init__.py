"""One iteration, captured on the training thread at the least cost.

- ``scaler.py``: what a scaler's iteration saw (found-inf per device, scale, stats), kept on
  the device and copied to the host once, off the hot path.
- ``watch.py``: the same for a :class:`~ampscope.GradWatch` iteration.
"""
