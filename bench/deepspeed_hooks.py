"""What the DeepSpeed integration's origin checks cost per micro-batch.

``python -m bench.deepspeed_hooks`` runs the backward of the 148-tensor GPT-shaped model of
:mod:`bench.tensor_growth` (CPU, one intra-op thread) three ways, three copies of the model
interleaved block by block (:mod:`bench.ab`):

* ``stock``: no check;
* ``hooked``: :class:`~ampscope.integrations.deepspeed.origin.OwnGradientFlags`, one tensor
  hook per parameter (what ``instrument`` registers on engines it does not recognise;
  ZeRO-3's check until the bucket check), paid on every micro-batch;
* ``boundary``: :class:`~ampscope.integrations.deepspeed.origin.BoundaryGradientFlags`, its
  one check of every ``.grad`` after the backward (what ``instrument`` runs at ZeRO-0/1
  right before the boundary's reduction). Timed on every backward, as if every micro-batch
  were a boundary (no gradient accumulation): the micro-batches inside an accumulation step
  run no check at all;
* ``bucket``: :class:`~ampscope.integrations.deepspeed.origin.BucketGradientFlags`, its
  check of one bucket holding the 148 gradients (what ``instrument`` runs at ZeRO-2 before
  each bucket's reduction; DeepSpeed's default bucket, 5e8 elements, holds this model
  whole), with the bucket's parameter ids read from DeepSpeed-shaped entries. The list of
  the bucket's gradients is DeepSpeed's and is built untimed;
* ``bucket3``: the same check through ZeRO-3's wrap
  (:func:`~ampscope.integrations.deepspeed.reduction.check_each_partition_bucket`) of a
  DeepSpeed-shaped ``DeepSpeedZeroOptimizer_Stage3`` whose one bucket holds the 148
  parameters (the reduction itself a no-op): timed from the call of the name-mangled
  ``__reduce_and_partition_ipg_grads``, so the wrap's own work (the bucket's gradients and
  ``ds_id`` read from its parameters) is counted too.

It prints the training thread's extra CPU time per micro-batch over ``stock`` (median over
block groups of the paired block medians, with the IQR), and per parameter. DeepSpeed
itself is not needed: these are the integration's per-micro-batch costs. Compare trees with
``PYTHONPATH=TREE`` from a directory without an ``ampscope/``.

Where other load makes the clocks too noisy, count instructions instead (load-independent):
``--instructions VARIANT STEPS`` runs one variant's loop (each step: zero_grad, forward,
backward, the check, ``take()``) with callgrind counting on around it only::

    valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        --callgrind-out-file=/tmp/cg/boundary.out \\
        python -m bench.deepspeed_hooks --instructions boundary 40

and thread 1's total (``*.out-01``) minus ``stock``'s, over the steps, is the variant's
instructions per micro-batch.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from bench.ab import interleaved_order
from bench.gpt import batch, build_gpt
from bench.tensor_growth import GPT_148

_PARAM_ID = operator.itemgetter(2)


VARIANTS = ("stock", "hooked", "boundary", "bucket", "bucket3")


class DeepSpeedZeroOptimizer_Stage3:  # DeepSpeed's name, which the wrap recognises
    """What ZeRO-3's wrap reads of DeepSpeed's optimizer: one bucket holding every
    parameter, no reduction stream (a synchronized device), a no-op reduction."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.ipg_buckets = {torch.float32: SimpleNamespace(params=params)}
        self.reduce_and_partition_stream = None

    def __reduce_and_partition_ipg_grads(self, communication_data_type: torch.dtype) -> None:
        pass

    def reduce(self) -> None:
        """As DeepSpeed calls it: ``self.__reduce_and_partition_ipg_grads(dtype)``."""
        self.__reduce_and_partition_ipg_grads(torch.float32)


class _Backward:
    def __init__(self, check: str) -> None:
        from ampscope.integrations.deepspeed.origin import (
            BoundaryGradientFlags,
            BucketGradientFlags,
            OwnGradientFlags,
        )

        self.model: nn.Module = build_gpt(GPT_148)
        self.tokens, self.targets = batch(GPT_148, "cpu")
        named = list(self.model.named_parameters())
        self.params = [param for _, param in named]
        self.hooks = OwnGradientFlags(named) if check == "hooked" else None
        self.boundary = BoundaryGradientFlags(named) if check == "boundary" else None
        ids = {id(param): index for index, param in enumerate(self.params)}
        self.bucket = (
            BucketGradientFlags(named, lambda param: ids[id(param)]) if check == "bucket" else None
        )
        # A ZeRO-2 bucket's entries: (group index, index in group, param id).
        self.entries = [(0, index, index) for index in range(len(self.params))]
        self.zero3: DeepSpeedZeroOptimizer_Stage3 | None = None
        if check == "bucket3":
            from ampscope.integrations.deepspeed import reduction as ds

            for index, param in enumerate(self.params):
                param.ds_id = index  # type: ignore[attr-defined]
            self.zero3 = DeepSpeedZeroOptimizer_Stage3(self.params)
            engine: Any = SimpleNamespace(optimizer=self.zero3)
            self.bucket = BucketGradientFlags(named, ds.partition_param_id)
            ds.check_each_partition_bucket(engine, self.bucket.check)

    def block(self, steps: int) -> float:
        """The median training-thread CPU seconds of ``steps`` backward passes (and the
        boundary check after each, for ``boundary``)."""
        times = []
        for _ in range(steps):
            self.model.zero_grad(set_to_none=True)
            loss = self.model(self.tokens, self.targets)
            begin = time.thread_time()
            loss.backward()
            if self.boundary is not None:
                self.boundary.check()
            elapsed = time.thread_time() - begin
            if self.zero3 is not None:
                begin = time.thread_time()
                self.zero3.reduce()
                elapsed += time.thread_time() - begin
            elif self.bucket is not None:
                # DeepSpeed's list of the bucket's gradients, untimed.
                grads = [param.grad for param in self.params if param.grad is not None]
                begin = time.thread_time()
                self.bucket.check(grads, tuple(map(_PARAM_ID, self.entries)))
                elapsed += time.thread_time() - begin
            times.append(elapsed)
            # Untimed: once per optimizer step, for all (the clocks time the backward).
            for flags in (self.hooks, self.boundary, self.bucket):
                if flags is not None:
                    flags.take()
        return statistics.median(times)


def _count(variant: str, steps: int) -> None:
    """One variant's loop with callgrind counting on around it (see the module docstring)."""
    from bench.step_instructions import instrument

    run = _Backward(variant)
    run.block(5)  # warm-up, not counted
    instrument(True)
    run.block(steps)
    instrument(False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--instructions",
        nargs=2,
        metavar=("VARIANT", "STEPS"),
        help=f"one of {', '.join(VARIANTS)}, and a step count: run under callgrind",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.instructions:
        _count(args.instructions[0], int(args.instructions[1]))
        return
    runs = {name: _Backward(name) for name in VARIANTS}
    for run in runs.values():
        run.block(5)  # warm-up
    extra: dict[str, list[float]] = {name: [] for name in VARIANTS[1:]}
    for group in range(args.groups):
        medians = {
            name: runs[name].block(args.steps) for name in interleaved_order(group, list(runs))
        }
        for name, values in extra.items():
            values.append(medians[name] - medians["stock"])
    params = sum(1 for _ in runs["stock"].model.parameters())
    for name, values in extra.items():
        quartiles = statistics.quantiles(values, n=4)
        median = statistics.median(values)
        print(
            f"{params} parameters, {name}: backward +{median * 1e6:.0f} us per micro-batch "
            f"(IQR {(quartiles[2] - quartiles[0]) * 1e6:.0f}), {median * 1e6 / params:.2f} us "
            "per parameter"
        )


if __name__ == "__main__":
    main()
