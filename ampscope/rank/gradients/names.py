"""Fully qualified parameter names for the optimizer's parameters.

``scaler.attach(model)`` records a name for each parameter of the (wrapped) model; the
non-finite attribution looks names up only on overflow iterations. FSDP1 FlatParameters
(``use_orig_params=False``) are resolved to the original parameters inside this rank's
shard, so a record names ``layers.3.attn.wo.weight`` rather than ``_flat_param``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ampscope.rank import compat


@dataclass(frozen=True)
class Segment:
    """A named slice of a flattened local gradient; ``numel=None`` means all of it."""

    name: str
    offset: int = 0
    numel: int | None = None


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP registers the user's module as `.module`; names should not start with "module.".
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


class ParamNames:
    """Parameter → name registry, holding neither the model nor its parameters alive."""

    def __init__(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.version = 0
        """Bumped by every walk: whoever caches names derived from these re-derives them."""

    def attach(self, model: nn.Module) -> None:
        """Name ``model``'s parameters. Call after wrapping (FSDP, DDP, ``fully_shard``)."""
        self._model = weakref.ref(model)
        self._walk()

    def _walk(self) -> None:
        model = self._model() if self._model is not None else None
        if model is None:
            return
        self.version += 1
        self._names = {
            id(param): (weakref.ref(param), name)
            for name, param in _unwrap(model).named_parameters(remove_duplicate=False)
        }

    def _lookup(self, param: torch.Tensor) -> str | None:
        entry = self._names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return None

    def segments(self, param: torch.Tensor, group: int, index: int) -> list[Segment]:
        """The named pieces of ``param``'s local gradient. Called on overflow iterations,
        and when the gradient-norm plan is (re)built: re-walks the attached model once if
        ``param`` is unknown."""
        name = self._lookup(param)
        if name is None and self._model is not None:
            self._walk()
            name = self._lookup(param)
        if name is None:
            return [Segment(f"group{group}.param{index}")]
        cleaned, is_flat = compat.clean_param_name(name)
        flat = compat.flat_param_segments(param) if is_flat else None
        if flat is None:
            return [Segment(cleaned or name)]
        return [Segment(cleaned + s.relative_name, s.offset, s.numel) for s in flat]
