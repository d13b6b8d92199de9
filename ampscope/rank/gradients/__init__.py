"""Readers of the gradients: what they hold, whose they were, and where they went bad.

- ``stats.py``: the iteration's loss and gradient norms.
- ``origin.py``, ``origin_hooks.py``: which rank's own gradients held inf/NaN before the
  reduction, and the hooks that put that check inside DDP, FSDP1 and FSDP2 collectives.
- ``attribution.py``, ``names.py``: which named parameters held non-finite values.
- ``local_unscale.py``: unscaling DTensor gradients on their local shards.
"""
