"""Did ``optimizer.step()`` run? Learned without reading found-inf again.

torch's ``_maybe_opt_step`` reads found-inf on the host (its ``.item()``) and calls
``optimizer.step()`` only when it is zero. A step pre-hook (public Optimizer API),
registered once per optimizer, tells whether that call happened, so the scaler knows
the iteration skipped without a second device read.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class StepProbe:
    """Watches ``optimizer.step()`` calls of the optimizers it is armed on."""

    def __init__(self) -> None:
        self._handles: dict[int, RemovableHandle] = {}
        self._fired: set[int] = set()

    def arm(self, optimizer: torch.optim.Optimizer) -> bool:
        """Reset ``optimizer``'s flag; registers the hook on first use. Returns ``False``
        for objects without ``register_step_pre_hook`` (then :meth:`fired` is meaningless)."""
        key = id(optimizer)
        if key not in self._handles:
            register = getattr(optimizer, "register_step_pre_hook", None)
            if register is None:
                return False
            probe = weakref.ref(self)

            def hook(opt: Any, args: Any, kwargs: Any) -> None:
                owner = probe()
                if owner is not None:
                    owner._fired.add(id(opt))

            self._handles[key] = register(hook)
            weakref.finalize(optimizer, self._forget, key)
        self._fired.discard(key)
        return True

    def fired(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer.step()`` ran since :meth:`arm`."""
        return id(optimizer) in self._fired

    def _forget(self, key: int) -> None:
        self._handles.pop(key, None)
        self._fired.discard(key)

    def remove(self) -> None:
        """Unregister every hook."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._fired.clear()
