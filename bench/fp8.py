"""What observing FP8 layers costs: step time with ampscope against the same run without.

``python -m bench.fp8`` trains a model of ``LAYERS`` torchao ``Float8Linear`` layers
(``Float8LinearConfig(emulate=True)``: the CPU's emulated FP8 casts and GEMMs) in bf16
autocast, four ways interleaved block by block (:mod:`bench.ab`): without ampscope, with a
``GradWatch`` attached to a model without FP8 observation, and with FP8 observation at the
default ``fp8_every`` and at ``fp8_every=1``. Prints and writes (``--out``) the per-group
ratios of each against the run without ampscope. Needs torchao (``ampscope[fp8]``).

``--gpu`` measures the same four contenders on a CUDA GPU with real FP8 matmuls (compute
capability 8.9 or later): the GPT-2-small-shaped model of :mod:`bench.gpt` (124M
parameters) with every ``nn.Linear`` of its blocks converted to ``Float8Linear`` (48
layers, tensorwise), bf16 autocast, fused AdamW, eager mode (no ``torch.compile``); each
step timed by CUDA events around it, one synchronize per block.

``--ops`` counts instead of timing: the operators an observed iteration adds per observed
tensor (:mod:`bench.fp8_ops`); with ``--out`` it writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.ab import compare_groups, run_interleaved

LAYERS = 12
WIDTH = 256
BATCH = 64


def _model(observed: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    model = nn.Sequential(*layers)
    if observed:
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    return model


def _front(model: nn.Module, fp8_every: int | None, watch: bool, run_id: str) -> Any:
    """``None`` without ampscope; else a ``GradWatch``, attached to ``model`` for FP8
    observation unless ``fp8_every`` is ``None`` (0: the default ``fp8_every``)."""
    from ampscope import GradWatch
    from ampscope.rank.config import DEFAULT_FP8_EVERY

    if not watch:
        return None
    front = GradWatch(reporter=None, run_id=run_id, stats=False)
    if fp8_every is not None:
        front.attach(model, fp8_every=fp8_every or DEFAULT_FP8_EVERY)
    return front


def _iteration(
    front: Any, optimizer: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor], device: str
) -> Callable[[], None]:
    """One bf16 training iteration, through ``front`` when there is one."""

    def iteration() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of()
        if front is None:
            loss.backward()
            optimizer.step()
        else:
            front.scale(loss).backward()
            front.step(optimizer)
            front.update()

    return iteration


def _contender(
    fp8_every: int | None, watch: bool, clock: Callable[[], float]
) -> Callable[[], float]:
    """One step function returning its time by ``clock``; ``fp8_every`` None: no FP8
    observation (the watch attached to a model handle without the FP8 layers)."""
    model = _model(observed=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    front = _front(model, fp8_every, watch, "bench-fp8")
    iteration = _iteration(front, optimizer, lambda: model(x).float().square().mean(), "cpu")

    def step() -> float:
        start = clock()
        iteration()
        return clock() - start

    return step


def run(groups: int, clock_name: str = "thread") -> dict[str, Any]:
    """Time the contenders; the ratios against ``no_ampscope``."""
    from ampscope.rank.config import DEFAULT_FP8_EVERY

    torch.set_num_threads(1)
    clock = time.thread_time if clock_name == "thread" else time.perf_counter
    contenders = {
        "no_ampscope": _contender(None, False, clock),
        "watch_without_fp8": _contender(None, True, clock),
        f"fp8_every_{DEFAULT_FP8_EVERY}_default": _contender(0, True, clock),
        "fp8_every_1": _contender(1, True, clock),
    }
    # A block is the default fp8_every steps, so each block holds one observed iteration.
    block = DEFAULT_FP8_EVERY
    for step in contenders.values():  # warm-up: torchao's first casts, allocator
        for _ in range(block):
            step()
    blocks = run_interleaved(contenders, lambda step: [step() for _ in range(block)], groups=groups)
    result = compare_groups(blocks, baseline="no_ampscope")
    result["config"] = {
        "layers": LAYERS,
        "width": WIDTH,
        "batch": BATCH,
        "block_steps": block,
        "groups": groups,
        "threads": torch.get_num_threads(),
        "clock": clock_name,
        "torch": torch.__version__,
    }
    return result


def _gpu_contender(
    fp8_every: int | None, watch: bool, shape_name: str
) -> Callable[[int], list[float]]:
    """A block function for the GPU: ``steps`` iterations, each timed by CUDA events."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from bench.gpt import SHAPES, batch, build_gpt

    shape = SHAPES[shape_name]
    model = build_gpt(shape)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=False))
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs = batch(shape, "cuda")
    front = _front(model, fp8_every, watch, "bench-fp8-gpu")
    iteration = _iteration(front, optimizer, lambda: model(*inputs), "cuda")

    def block(steps: int) -> list[float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            iteration()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]

    return block


def run_gpu(groups: int, shape_name: str = "gpt2-small") -> dict[str, Any]:
    """The four contenders on the GPU, interleaved by blocks of the default ``fp8_every``."""
    from ampscope.rank.config import DEFAULT_FP8_EVERY
    from bench.gpt import SHAPES

    contenders = {
        "no_ampscope": _gpu_contender(None, False, shape_name),
        "watch_without_fp8": _gpu_contender(None, True, shape_name),
        f"fp8_every_{DEFAULT_FP8_EVERY}_default": _gpu_contender(0, True, shape_name),
        "fp8_every_1": _gpu_contender(1, True, shape_name),
    }
    block = DEFAULT_FP8_EVERY
    for run_block in contenders.values():  # warm-up: torchao's first casts, cuBLAS plans
        run_block(block)
    blocks = run_interleaved(contenders, lambda run_block: run_block(block), groups=groups)
    result = compare_groups(blocks, baseline="no_ampscope")
    result["config"] = {
        "model": SHAPES[shape_name].as_dict(),
        "float8_linear_layers": 48 if shape_name == "gpt2-small" else None,
        "recipe": "tensorwise",
        "precision": "bf16 autocast",
        "optimizer": "AdamW fused",
        "block_steps": block,
        "groups": groups,
        "clock": "cuda events",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
    }
    return result


CONTENDERS = ("no_ampscope", "watch_without_fp8", "fp8_default", "fp8_every_1")
"""The runs compared, by name (``fp8_default``: the default ``fp8_every``)."""


def count_instructions(name: str, steps: int) -> None:
    """Run ``name``'s loop for ``steps`` steps with callgrind counting only them (started
    with ``--instr-atstart=no``): instruction counts do not move with other load on a
    shared host, where the clocks cannot resolve 2 %. ``steps``: a multiple of the default
    ``fp8_every``, so each run holds as many observed iterations as the default gives."""
    from bench.step_instructions import instrument

    torch.set_num_threads(1)
    fp8_every = {"no_ampscope": None, "watch_without_fp8": None, "fp8_default": 0}.get(name, 1)
    step = _contender(fp8_every, name != "no_ampscope", time.thread_time)
    for _ in range(10):  # warm-up: torchao's first casts, the first update()'s identity
        step()
    instrument(True)
    for _ in range(steps):
        step()
    instrument(False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__)
    parser.add_argument("--groups", type=int, default=8, help="interleaved block groups")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument(
        "--instructions",
        choices=CONTENDERS,
        default=None,
        help="run this one contender under valgrind's callgrind instead (see the module doc)",
    )
    parser.add_argument("--steps", type=int, default=50, help="measured steps (--instructions)")
    parser.add_argument(
        "--gpu", action="store_true", help="the GPT-2-small model on a CUDA GPU, real FP8 matmuls"
    )
    parser.add_argument("--shape", default="gpt2-small", help="with --gpu: gpt2-small or tiny")
    parser.add_argument(
        "--ops", action="store_true", help="count the operators added per observed tensor"
    )
    args = parser.parse_args(argv)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    if args.ops:
        from bench.fp8_ops import count_ops, print_ops

        counted = count_ops()
        print_ops(counted)
        if args.out is not None:
            args.out.write_text(json.dumps(counted, indent=2) + "\n")
        return
    if args.instructions is not None:
        count_instructions(args.instructions, args.steps)
        return
    result = run_gpu(args.groups, args.shape) if args.gpu else run(args.groups, args.clock)
    for name, ratio in result["ratio"].items():
        print(
            f"{name:>26}: x{ratio['median']:.4f} (IQR {ratio['p25']:.4f}-{ratio['p75']:.4f}, "
            f"95% CI {ratio['ci_low']:.4f}-{ratio['ci_high']:.4f})"
        )
    base = result["samples"]["no_ampscope"]
    print(f"{'no_ampscope step':>26}: {base['median']:.1f} ms median")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
