"""Readers of the gradients: what they hold, whose they were, and where they went bad.

- ``stats.py``: the iteration's loss and gradient norms.
- ``nonfinite.py``: found-inf flags: gradients grouped as torch's unscale groups them, the
  watch's fused check, several flags made one per device.
- ``origin.py``, ``origin_hooks.py``: which rank's own gradients held inf/NaN before the
  reduction (the flags), and the hooks that put that check inside DDP, FSDP1 and FSDP2
  collectives (:func:`~ampscope.rank.gradients.origin_hooks.install_origin_hooks`).
- ``attribution.py``, ``names.py``: which named parameters held non-finite values.
- ``local_unscale.py``: unscaling DTensor gradients on their local shards.
"""
