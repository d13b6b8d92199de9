"""What observing one FP8 tensor launches: operators counted, not timed.

Eager FP8 steps on a GPU are bound by the host's kernel launches, so the cost of an
observed iteration is the number of operators its observation adds per observed
(layer, tensor). ``python -m bench.fp8 --ops`` counts them deterministically with
``torch.profiler`` on the CPU: the tiny GPT of :mod:`bench.gpt` with torchao
``Float8Linear`` layers (emulated), one profiled iteration observed (``fp8_every=1``)
against one not observed, per recipe. Two counts per observed tensor:

* ``aten_ops``: every ``aten::`` operator recorded (views, allocations and nested calls
  included): the dispatcher's work on the host.
* ``kernel_ops``: the operators that do work on the data (:func:`_is_kernel`): the
  reductions, and the innermost operators that are neither a view, an allocation nor
  metadata (:data:`NO_KERNEL`). On a GPU each is about one kernel launch. Where a GPU
  differs: CUDA's ``count_nonzero`` is three kernels (``ne``, a copy to int64, ``sum``),
  the CPU's one; and where dtypes differ (bf16 autocast), the CPU's ``TensorIterator``
  copies an operand to a temporary (``copy_``), which a CUDA kernel casts in place, as it
  does a bf16 input of a float32 reduction. In float32 neither happens: those counts are
  the closer to a GPU's launches.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Any

import torch

NO_KERNEL = frozenset(
    "aten::" + name
    for name in (
        "_reshape_alias",
        "_unsafe_view",
        "alias",
        "as_strided",
        "detach",
        "detach_",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "flatten",
        "lift_fresh",
        "permute",
        "reshape",
        "resize_",
        "result_type",
        "select",
        "slice",
        "split",
        "squeeze",
        "t",
        "to",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "view_as",
    )
)
"""Operators that launch no kernel when they are leaves (``aten::to`` without a copy)."""

REDUCTIONS = frozenset(
    "aten::" + name
    for name in (
        "amax",
        "amin",
        "aminmax",
        "count_nonzero",
        "linalg_vector_norm",
        "max",
        "mean",
        "min",
        "sum",
    )
)
"""Operators that are one kernel even with operators under them: the CPU's reductions
fill their output before accumulating (a ``fill_`` a GPU does not launch), and call
``aten::to`` where the input's dtype differs (a copy the GPU launches too)."""

TENSORS_PER_LAYER = 3
"""input, weight, grad_output."""


def _is_kernel(event: Any) -> bool:
    """One kernel launch on a GPU: a reduction, or an operator that is neither a view, an
    allocation nor a reduction's initial fill, with no such operator under it."""
    if event.name in REDUCTIONS:
        return True
    if event.name in NO_KERNEL:
        return False
    parent = event.cpu_parent
    if event.name == "aten::fill_" and parent is not None and parent.name in REDUCTIONS:
        return False
    return not any(_does_work(child) for child in event.cpu_children)


def _does_work(event: Any) -> bool:
    return _is_kernel(event) or any(_does_work(child) for child in event.cpu_children)


def _profile_iteration(
    every: int, recipe: str, autocast: bool
) -> tuple[Counter[str], Counter[str], int]:
    """All aten operators and the kernel-like ones of the 4th iteration (the first three
    warm up; with ``every=1000`` the 4th is not observed), and how many tensors an
    observed iteration observes."""
    from torch.profiler import ProfilerActivity, profile
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import Float8LinearRecipeName

    import ampscope
    from ampscope.rank.fp8.observer import float8_layers
    from bench.gpt import SHAPES, batch, build_gpt

    shape = SHAPES["tiny"]
    model = build_gpt(shape)
    base = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName(recipe))
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields["emulate"] = True
    convert_to_float8_training(model, config=Float8LinearConfig(**fields))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = batch(shape, "cpu")
    watch = ampscope.GradWatch(reporter=None, stats=False)
    watch.attach(model, fp8_every=every)

    def iteration() -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(*inputs)
        watch.scale(loss).backward()
        watch.step(optimizer)
        watch.update()

    for _ in range(3):
        iteration()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        iteration()
    watch.close()
    aten: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        aten[event.name] += 1
        if _is_kernel(event):
            kernels[event.name] += 1
    return aten, kernels, TENSORS_PER_LAYER * len(float8_layers(model))


def count_ops(recipes: tuple[str, ...] = ("tensorwise", "rowwise")) -> dict[str, Any]:
    """Operators added per observed tensor, per recipe and precision: totals and, for the
    kernel-like ones, by operator name."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for recipe, autocast in itertools.product(recipes, (False, True)):
        aten_off, kernels_off, _ = _profile_iteration(1000, recipe, autocast)
        aten_on, kernels_on, tensors = _profile_iteration(1, recipe, autocast)
        added = {
            name: (kernels_on[name] - kernels_off[name]) / tensors
            for name in sorted(set(kernels_on) | set(kernels_off))
            if kernels_on[name] != kernels_off[name]
        }
        out[f"{recipe}, {'bf16 autocast' if autocast else 'float32'}"] = {
            "observed_tensors": tensors,
            "aten_ops": (aten_on.total() - aten_off.total()) / tensors,
            "kernel_ops": (kernels_on.total() - kernels_off.total()) / tensors,
            "kernel_ops_by_name": {k: round(v, 3) for k, v in added.items()},
        }
    out["how"] = (
        "python -m bench.fp8 --ops: torch.profiler (CPU) of one iteration with fp8_every=1 "
        "minus one not observed, tiny GPT (bench.gpt), emulated Float8Linear"
    )
    out["torch"] = torch.__version__
    return out


def print_ops(result: dict[str, Any]) -> None:
    for recipe, counts in result.items():
        if not isinstance(counts, dict):
            continue
        print(
            f"{recipe}: per observed tensor (of {counts['observed_tensors']}): "
            f"{counts['aten_ops']:.2f} aten ops, {counts['kernel_ops']:.2f} kernel-like ops"
        )
        for name, count in counts["kernel_ops_by_name"].items():
            print(f"    {count:6.2f}  {name}")
