"""What the gradient norms cost per element: a wide model, where bandwidth shows.

``python -m bench.norm_cost`` trains a 6-layer MLP of width 1024 (12 tensors, 6.3M
parameters) in bf16 autocast on the CPU with AdamW, four loops interleaved block by block
in one process (:mod:`bench.ab`):

* ``stock`` / ``ampscope``: ``torch.amp.GradScaler`` against ``ampscope.GradScaler`` with
  the defaults (its own norm pass after the unscale);
* ``stock_clip`` / ``ampscope_clip``: the same loops clipping after ``unscale_``, stock
  with ``torch.nn.utils.clip_grad_norm_``, ampscope with its ``clip_grad_norm_`` (the
  clip's pass gives the norms: no pass of its own);
* ``stock_pass``: the stock loop with one norm pass of its own after the unscale, timed
  apart within the step (the pass ampscope's defaults add: torch's multi-tensor norm,
  which is also what ampscope runs for gradients this large). Its share of the rest of
  the same step is a paired figure that the host's noise moves far less than the ratio of
  two loops' steps.

Reports each ampscope loop's step time over its stock loop's, as the median over block
groups of the ratio of block medians (training thread CPU time, which other processes on
a shared host do not move), with the interquartile range of those ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.ab import interleaved_order

WIDTH = 1024
LAYERS = 6
BATCH = 64


class Loop:
    """One contender: a model copy, AdamW, a scaler; clipping or not."""

    def __init__(self, ampscope_on: bool, clip: bool, timed_pass: bool = False) -> None:
        from ampscope import GradScaler
        from ampscope.reporter.sinks import CallbackSink

        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self.model = nn.Sequential(*layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
        self.clip = clip
        self.timed_pass = timed_pass
        self.last_pass = 0.0
        self.scaler: Any = (
            GradScaler("cpu", reporter=CallbackSink(lambda record: None), run_id="norm-cost")
            if ampscope_on
            else torch.amp.GradScaler("cpu")
        )

    def step(self) -> float:
        start = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(self.x).float().square().mean()
        scaler = self.scaler
        scaler.scale(loss).backward()
        if self.timed_pass:
            scaler.unscale_(self.optimizer)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            begin = time.thread_time()
            torch._foreach_norm(grads)
            self.last_pass = time.thread_time() - begin
        if self.clip:
            scaler.unscale_(self.optimizer)
            clip = getattr(scaler, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
            clip(self.model.parameters(), 1.0)
        scaler.step(self.optimizer)
        scaler.update()
        return time.thread_time() - start

    def close(self) -> None:
        close = getattr(self.scaler, "close", None)
        if close is not None:
            close()


def run(groups: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    loops = {
        "stock": Loop(False, False),
        "ampscope": Loop(True, False),
        "stock_clip": Loop(False, True),
        "ampscope_clip": Loop(True, True),
        "stock_pass": Loop(False, False, timed_pass=True),
    }
    shares: list[float] = []
    passes: list[float] = []
    try:
        for loop in loops.values():
            for _ in range(2):
                loop.step()
        ratios: dict[str, list[float]] = {"ampscope": [], "ampscope_clip": []}
        medians: dict[str, list[float]] = {name: [] for name in loops}
        for group in range(groups):
            per: dict[str, float] = {}
            for name in interleaved_order(group, list(loops)):
                times = []
                for _ in range(steps):
                    times.append(loops[name].step())
                    if name == "stock_pass":
                        spent = loops[name].last_pass
                        passes.append(spent)
                        shares.append(spent / (times[-1] - spent))
                per[name] = statistics.median(times)
                medians[name].append(per[name])
            ratios["ampscope"].append(per["ampscope"] / per["stock"])
            ratios["ampscope_clip"].append(per["ampscope_clip"] / per["stock_clip"])
    finally:
        for loop in loops.values():
            loop.close()
    out: dict[str, Any] = {
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}), batch {BATCH}, bf16 autocast, AdamW",
        "parameters": sum(p.numel() for p in loops["stock"].model.parameters()),
        "groups": groups,
        "steps_per_block": steps,
        "step_ms": {name: statistics.median(v) * 1e3 for name, v in medians.items()},
    }
    for name, values in ratios.items():
        out[f"{name}_ratio"] = statistics.median(values)
        out[f"{name}_ratio_iqr"] = _iqr(values)
    millions = out["parameters"] / 1e6
    out["norm_pass_ms"] = statistics.median(passes) * 1e3
    out["norm_pass_ms_per_million"] = out["norm_pass_ms"] / millions
    out["norm_pass_share"] = statistics.median(shares)
    out["norm_pass_share_iqr"] = _iqr(shares)
    return out


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return float("nan")
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.norm_cost", description=__doc__)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="iterations per block")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    result = {"label": args.label, **run(args.groups, args.steps)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
