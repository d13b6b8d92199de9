"""The hooks that observe a model's ``Float8Linear`` layers, and one iteration's values.

:class:`Fp8Observer` registers, on each layer, a forward pre-hook (``input`` and
``weight``: what the layer is about to cast) and a forward hook that, on an observed
iteration only, puts a hook on the layer's output for its gradient (``grad_output``: what
the layer's backward casts). Iterations not observed cost one attribute test per layer
and forward. On an observed iteration each tensor's statistics
(:func:`~ampscope.rank.fp8.casts.cast_stats`: one-element tensors) stay on its device;
:meth:`Fp8Observer.take` hands them, joined by one ``torch.cat`` into one float32 vector,
to the step's own device-to-host copy (``PendingStep.extra``), with an :class:`Fp8Taken`
that names its values and holds what the host needs to decode them (sizes, sources).
Nothing is read on the training thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampscope.rank import compat
from ampscope.rank.compat import Float8Cast
from ampscope.rank.fp8.casts import VALUES, CastStats, Source, cast_stats, precast_stats

Fp8TensorName = Literal["input", "weight", "grad_output"]
CastName = Literal["output_gemm", "grad_input_gemm", "fsdp_all_gather"]

TENSORS: tuple[Fp8TensorName, ...] = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Fp8Slot:
    """One observed (layer, tensor) and the cast its values describe."""

    layer: str
    """The module's fully qualified name in the model (wrapper prefixes removed)."""
    tensor: Fp8TensorName
    cast: CastName
    """``output_gemm``: the cast of ``input`` or ``weight`` for the GEMM computing the
    output; ``grad_input_gemm``: the cast of ``grad_output`` for the GEMM computing
    ``grad_input``; ``fsdp_all_gather``: the weight FSDP2 cast per shard, with the amax
    reduced over the shards, before gathering it in FP8."""
    dtype: str
    """The FP8 dtype, e.g. ``float8_e4m3fn``."""
    rowwise: bool
    power_of_2: bool
    """torchao's ``round_scales_to_power_of_2``."""
    fp8_max: float
    """The dtype's largest finite value, the numerator of torchao's scale."""


@dataclass(frozen=True)
class Fp8Taken:
    """Names the values of one observed iteration: ``slots[i]`` owns the ``VALUES`` values
    from ``VALUES * i`` (high, underflowed, nonzero, low: :class:`~ampscope.rank.fp8.casts.
    CastStats`), combined over ``calls[i]`` casts (a layer run several times: gradient
    accumulation, recomputation): the largest high, the smallest low, the summed counts."""

    slots: tuple[Fp8Slot, ...]
    calls: tuple[int, ...]
    numel: tuple[int, ...]
    """Elements counted, summed over the calls."""
    sources: tuple[Source, ...]
    """What ``high`` and ``low`` hold (``CastStats.source``)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _combined(parts: list[CastStats]) -> list[torch.Tensor]:
    """Several casts of one tensor in an iteration: the largest high, the summed counts,
    the smallest low (four ops). torch's max propagates NaN, as a non-finite amax must."""
    if len(parts) == 1:
        return list(parts[0].values)
    stacked = torch.cat([value for part in parts for value in part.values])
    stacked = stacked.view(len(parts), VALUES)
    high, summed, low = stacked.amax(0), stacked.sum(0), stacked.amin(0)
    return [high[0:1], summed[1:2], summed[2:3], low[3:4]]


class _Layer:
    __slots__ = ("casts", "index", "name", "shard", "slots")

    def __init__(self, index: int, name: str, casts: list[Float8Cast]) -> None:
        self.index = index
        self.name = name
        self.casts = {cast.tensor: cast for cast in casts}
        self.shard: Callable[[], torch.Tensor | None] = lambda: None
        self.slots: dict[tuple[str, str], Fp8Slot] = {}

    def slot(self, tensor: Fp8TensorName, cast_name: CastName) -> Fp8Slot:
        key = (tensor, cast_name)
        found = self.slots.get(key)
        if found is None:
            cast = self.casts[tensor]
            found = self.slots[key] = Fp8Slot(
                layer=self.name,
                tensor=tensor,
                cast=cast_name,
                dtype=_dtype_name(cast.dtype),
                rowwise=cast.rowwise,
                power_of_2=cast.power_of_2,
                fp8_max=torch.finfo(cast.dtype).max,
            )
        return found


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def float8_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's ``Float8Linear`` modules with their names; empty without torchao."""
    cls = compat.float8_linear_type()
    if cls is None:
        return []
    out: list[tuple[str, nn.Module]] = []
    for name, module in _unwrap(model).named_modules():
        if type(module) is cls or issubclass(type(module), cls):
            cleaned, _ = compat.clean_param_name(name)
            out.append((cleaned or name, module))
    return out


class Fp8Observer:
    """Observes every ``Float8Linear`` of a model on one iteration in ``every``.

    Args:
        layers: The layers (from :func:`float8_layers`).
        every: Observe the first iteration and then one in ``every``.
        shards: This rank's high-precision weight shard by ``id()`` of its module, for the
            weights FSDP2 gathers in FP8 (``compat.float8_sharded_weights``).
    """

    def __init__(
        self,
        layers: list[tuple[str, nn.Module]],
        every: int,
        shards: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.every = every
        self.armed = True
        """Whether the open iteration is observed."""
        self._iteration = 0
        self._layers: list[_Layer] = []
        self._values: dict[tuple[int, int], list[CastStats]] = {}
        self._slots: dict[tuple[int, int], Fp8Slot] = {}
        self._handles: list[RemovableHandle] = []
        shards = shards or {}
        for index, (name, module) in enumerate(layers):
            layer = _Layer(index, name, compat.float8_casts(module))
            shard = shards.get(id(module))
            if shard is not None:
                layer.shard = weakref.ref(shard)
            self._layers.append(layer)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(layer)))
            if "grad_output" in layer.casts:
                self._handles.append(module.register_forward_hook(self._post_hook(layer)))

    @property
    def layers(self) -> tuple[str, ...]:
        """The observed layers' names."""
        return tuple(layer.name for layer in self._layers)

    def close(self) -> None:
        """Remove every hook. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._values = {}

    def take(self) -> tuple[torch.Tensor, Fp8Taken] | None:
        """Close the iteration: its values (one float32 vector on the first layer's device,
        its copy not yet started) and their names, or ``None`` when it was not observed.
        Arms the next iteration if it is one to observe. Training thread; no sync."""
        values, self._values = self._values, {}
        self._iteration += 1
        self.armed = self._iteration % self.every == 0
        if not values:
            return None
        keys = sorted(values)
        parts = [value for key in keys for value in _combined(values[key])]
        device = parts[0].device
        vector = torch.cat([p if p.device == device else p.to(device) for p in parts])
        taken = Fp8Taken(
            slots=tuple(self._slots[key] for key in keys),
            calls=tuple(len(values[key]) for key in keys),
            numel=tuple(sum(part.numel for part in values[key]) for key in keys),
            sources=tuple(values[key][-1].source for key in keys),
        )
        return vector, taken

    def restart(self) -> None:
        """Forget what the open iteration observed so far, keeping it armed: a rerun's
        second pass replaces the first, and the record describes that pass alone. O(1)."""
        self._values = {}

    # -- hooks ---------------------------------------------------------------------------

    def _add(self, layer: _Layer, tensor: Fp8TensorName, cast: CastName, stats: CastStats) -> None:
        key = (layer.index, TENSORS.index(tensor))
        self._slots[key] = layer.slot(tensor, cast)
        found = self._values.get(key)
        if found is None:
            self._values[key] = [stats]
        else:
            found.append(stats)

    def _pre_hook(self, layer: _Layer) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self.armed:
                return
            try:
                self._observe_forward(layer, module, args)
            except Exception:  # telemetry never raises into training
                self._failed()

        return hook

    def _post_hook(self, layer: _Layer) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self.armed or not isinstance(output, torch.Tensor):
                return
            if output.requires_grad:
                output.register_hook(self._grad_hook(layer))

        return hook

    def _grad_hook(self, layer: _Layer) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            try:
                # The bias add passes the gradient through: this is what the layer's
                # backward reshapes to 2-D and casts for the grad_input GEMM (its rows
                # are the last dim's: the statistics need no reshape).
                stats = cast_stats(grad, layer.casts["grad_output"])
                self._add(layer, "grad_output", "grad_input_gemm", stats)
            except Exception:
                self._failed()

        return hook

    def _observe_forward(self, layer: _Layer, module: nn.Module, args: tuple[Any, ...]) -> None:
        casts = layer.casts
        if "input" in casts and args and isinstance(args[0], torch.Tensor):
            x = compat.float8_layer_input(args[0])
            self._add(layer, "input", "output_gemm", cast_stats(x, casts["input"]))
        cast = casts.get("weight")
        if cast is None:
            return
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        precast = compat.float8_precast(weight)
        if precast is None:
            self._add(layer, "weight", "output_gemm", cast_stats(weight, cast))
        else:
            data, scale = precast
            stats = precast_stats(layer.shard(), data, scale, cast)
            self._add(layer, "weight", "fsdp_all_gather", stats)

    errors = 0
    """Exceptions swallowed in hooks (the first one is logged)."""

    def _failed(self) -> None:
        self.errors += 1
        if self.errors == 1:
            import logging

            logging.getLogger("ampscope").warning(
                "ampscope: FP8 observation error, training continues (logged once)",
                exc_info=True,
            )
