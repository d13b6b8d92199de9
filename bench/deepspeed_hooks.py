"""What the DeepSpeed integration's own-gradient hooks cost per parameter and micro-batch.

``python -m bench.deepspeed_hooks`` runs the backward of the 148-tensor GPT-shaped model of
:mod:`bench.tensor_growth` (CPU, one intra-op thread) with and without
:class:`~ampscope.integrations._deepspeed_hooks.OwnGradientFlags` on its parameters (one
tensor hook each, as ``ampscope.integrations.deepspeed.instrument`` registers them), two
copies of the model interleaved block by block (:mod:`bench.ab`), and prints the training
thread's extra CPU time per backward and per parameter (median over block groups of the
paired block medians, with the IQR). DeepSpeed itself is not needed: the hooks are the
integration's per-micro-batch cost. Compare trees with ``PYTHONPATH=TREE`` from a
directory without an ``ampscope/``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bench.ab import interleaved_order
from bench.gpt import batch, build_gpt
from bench.tensor_growth import GPT_148


class _Backward:
    def __init__(self, hooked: bool) -> None:
        from ampscope.integrations._deepspeed_hooks import OwnGradientFlags

        self.model: nn.Module = build_gpt(GPT_148)
        self.tokens, self.targets = batch(GPT_148, "cpu")
        self.flags = OwnGradientFlags(self.model.named_parameters()) if hooked else None

    def block(self, steps: int) -> float:
        """The median training-thread CPU seconds of ``steps`` backward passes."""
        times = []
        for _ in range(steps):
            self.model.zero_grad(set_to_none=True)
            loss = self.model(self.tokens, self.targets)
            begin = time.thread_time()
            loss.backward()
            times.append(time.thread_time() - begin)
        if self.flags is not None:
            self.flags.take()
        return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = {"stock": _Backward(False), "hooked": _Backward(True)}
    for run in runs.values():
        run.block(5)  # warm-up
    extra = []
    for group in range(args.groups):
        medians = {
            name: runs[name].block(args.steps) for name in interleaved_order(group, list(runs))
        }
        extra.append(medians["hooked"] - medians["stock"])
    params = sum(1 for _ in runs["stock"].model.parameters())
    quartiles = statistics.quantiles(extra, n=4)
    median = statistics.median(extra)
    print(
        f"{params} parameters: backward +{median * 1e6:.0f} us with the hooks "
        f"(IQR {(quartiles[2] - quartiles[0]) * 1e6:.0f}), {median * 1e6 / params:.2f} us per "
        "parameter and micro-batch"
    )


if __name__ == "__main__":
    main()
