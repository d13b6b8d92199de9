"""OLMo-core's clip repeat: what ampscope adds per step before the clip, by parameter count.

Each step the OLMo-core integration decides, before the watch's check, whether the clip
keeps its norms (``_KeptClip.keeps_norms``), and reads the gradients again at the clip
(a callback may have replaced some). ``read-twice`` decides by reading every gradient (how
it was); ``read-once`` decides from the layout learnt on first sight and reads them at the
clip only (``read_grads=False``). Both then read them at the clip (:func:`with_grads`);
the clip itself, the same in both, is not run. No torch op: only the Python around it.

Under callgrind, counting only the measured steps::

    valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=/tmp/cg/twice.out python -m bench.clip_decision read-twice
    valgrind ... --callgrind-out-file=/tmp/cg/once.out python -m bench.clip_decision read-once

(total - total) / steps is the difference per step (``callgrind_annotate`` prints each
total). Without ``--callgrind`` it prints the CPU time per step of both (``--params N``,
default 291: OLMo-2 7B's parameter tensors), a rough figure on a shared host.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ampscope.integrations import _clip_repeat
from ampscope.integrations.olmo_core import _keeping_call


def _params(count: int) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    for _ in range(count):
        param = torch.nn.Parameter(torch.zeros(4))
        param.grad = torch.ones(4)
        params.append(param)
    return params


def _step(model: Any, layouts: _clip_repeat.Layouts, listed: Any, read_grads: bool) -> None:
    call = _keeping_call(layouts, model, 1.0, params=listed, read_grads=read_grads)
    assert call is not None
    assert _clip_repeat.with_grads(call) is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("read-twice", "read-once"))
    parser.add_argument("--params", type=int, default=291)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    params = _params(args.params)
    model = torch.nn.Module()  # stands for the model: _keeping_call only asks its type
    listed = (params, tuple(map(id, params)))
    modes = [args.mode] if args.mode else ["read-twice", "read-once"]
    for mode in modes:
        layouts: _clip_repeat.Layouts = {}
        read_grads = mode == "read-twice"
        for _ in range(20):  # warm-up: first sight learns the layout
            _step(model, layouts, listed, read_grads)
        if args.mode:
            from bench.step_instructions import instrument

            instrument(True)
            for _ in range(args.steps):
                _step(model, layouts, listed, read_grads)
            instrument(False)
            continue
        best = float("inf")
        for _ in range(7):
            start = time.thread_time()
            for _ in range(args.steps):
                _step(model, layouts, listed, read_grads)
            best = min(best, (time.thread_time() - start) / args.steps)
        print(f"{mode}: {best * 1e6:.1f} us per step, {args.params} parameters")


if __name__ == "__main__":
    main()
