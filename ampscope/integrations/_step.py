"""Route a training library's own ``optimizer.step()`` call through a ``GradWatch``.

OLMo-core and torchtitan call ``optimizer.step()`` themselves, after clipping, with no
scaler in between. :class:`StepThroughWatch` sets ``step`` on the optimizer *instance*
so that that call becomes ``watch.step(optimizer)``, which applies the policy and, to
step, calls ``optimizer.step()`` again: that inner call reaches the method the optimizer
had before (its class's, with torch's step hooks, or an LR scheduler's counting wrapper).
The optimizer object, its state and its checkpoints stay the library's.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ampscope import GradWatch

_STEP = "step"


class StepThroughWatch:
    """``optimizer.step()`` as ``watch.step(optimizer)`` until :meth:`remove`.

    Args:
        watch: The watch whose policy decides each step.
        optimizer: The optimizer the library steps.
    """

    def __init__(self, watch: GradWatch, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._own = vars(optimizer).get(_STEP)  # an instance attribute set before ours
        inner = optimizer.step
        inside = False

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            nonlocal inside
            if inside:  # watch.step() stepping: the optimizer's own step
                return inner(*args, **kwargs)
            inside = True
            try:
                return watch.step(opt, *args, **kwargs)
            finally:
                inside = False

        # A bound method, as torch's LR schedulers expect when they wrap it in turn.
        self._step = types.MethodType(step, optimizer)
        optimizer.step = self._step  # type: ignore[method-assign]

    def remove(self) -> None:
        """Give the optimizer its ``step`` back (when still ours). Idempotent."""
        if vars(self.optimizer).get(_STEP) is not self._step:  # replaced since: leave it
            return
        if self._own is None:
            delattr(self.optimizer, _STEP)
        else:
            self.optimizer.step = self._own  # type: ignore[method-assign]
