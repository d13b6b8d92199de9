"""How ampscope's per-iteration CPU cost grows with the number of parameter tensors.

``python -m bench.tensor_growth`` runs the same loops at two model sizes, with few elements
per tensor so that the per-tensor work shows rather than the arithmetic:

* ``16``: eight ``nn.Linear(32, 32)`` layers (16 tensors);
* ``148``: a 12-block GPT-shaped stack of width 32 (:mod:`bench.gpt`, 148 tensors).

and four setups, each ampscope against what users run without it, interleaved block by
block in one process (:mod:`bench.ab`):

* ``scaler``: ``torch.amp.GradScaler`` against ``ampscope.GradScaler``;
* ``scaler-clip``: the same loops clipping after ``unscale_``, stock with
  ``torch.nn.utils.clip_grad_norm_``, ampscope with its ``clip_grad_norm_`` (one pass);
* ``watch``: a plain loop against ``GradWatch("observe")``;
* ``origin``: the scalers under 1-rank DDP (gloo), ampscope with ``track_origin=True``;
* ``fp8``: ``GradWatch`` with FP8 observation at the default ``fp8_every`` on the model's
  linear layers converted to torchao ``Float8Linear`` (emulated; skipped without torchao).

ampscope's records go to a sink that counts them; every block ends once the telemetry
thread has built every record of the block, so its work lands in the block that caused it.
Per iteration it reports the CPU time of the training thread (``time.thread_time``) and of
every other thread of the process together (``time.process_time`` minus the training
thread's), one intra-op thread, ampscope minus stock as the median over block groups of
the paired block medians (training thread) or block totals (other threads). Also the
training thread's CPU time *after backward* (from the end of ``backward()`` to the end of
``update()``: unscale, clip, step, update), paired the same way: where the scalers' and the
watch's own work lies, without the noise of the forward and backward, which the two loops
run alike (origin tracking's hooks and FP8's casts run inside them, so for those setups
only the whole iteration counts).

``--instructions SETUP SIZE NAME`` instead runs one contender's loop for ``--steps``
iterations with callgrind's counting on around them (see :mod:`bench.step_instructions`)::

    valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        --callgrind-out-file=/tmp/cg/s148.out \\
        python -m bench.tensor_growth --instructions scaler 148 ampscope --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.ab import interleaved_order
from bench.gpt import GPTShape, batch, build_gpt

SIZES = (16, 148)
SETUPS = ("scaler", "scaler-clip", "watch", "origin", "fp8")
GPT_148 = GPTShape(layers=12, heads=2, width=32, vocab=64, context=16, batch=2)


def _model(size: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model of ``size`` tensors and its loss function (float32)."""
    if size == 16:
        torch.manual_seed(0)
        mlp = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        return mlp, lambda model: model(x).float().square().mean()
    gpt = build_gpt(GPT_148)
    tokens, targets = batch(GPT_148, "cpu")
    return gpt, lambda model: model(tokens, targets)


class _Counter:
    """Counts the records a front-end emits (a ``CallbackSink``'s function)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, record: object) -> None:
        self.count += 1


class Contender:
    """One loop: a model, its optimizer, its front-end (``None``: a plain loop)."""

    def __init__(self, setup: str, size: int, ampscope_on: bool) -> None:
        from ampscope import GradScaler, GradWatch
        from ampscope.reporter.sinks import CallbackSink

        model, self._loss_of = _model(size)
        if setup == "fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
        self.records = _Counter()
        sink = CallbackSink(self.records)
        self.front: Any = None
        self.expect_records = ampscope_on
        if setup == "origin":
            model = nn.parallel.DistributedDataParallel(model)
        self.clip = setup == "scaler-clip"
        if setup in ("scaler", "scaler-clip", "origin"):
            if ampscope_on:
                self.front = GradScaler("cpu", reporter=sink, run_id=f"growth-{setup}")
                self.front.attach(model, track_origin=setup == "origin")
            else:
                self.front = torch.amp.GradScaler("cpu")
        elif ampscope_on:
            self.front = GradWatch("observe", reporter=sink, run_id=f"growth-{setup}")
            self.front.attach(model)
        self.model = model
        self.autocast = setup == "fp8"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.steps = 0
        self.section = 0.0
        """The last iteration's training-thread CPU seconds from the end of backward to the
        end of the iteration (unscale, clip, step, update): where the scalers' and the
        watch's per-iteration work lies, without the forward and backward's noise."""

    def iteration(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self._loss_of(self.model)
        front = self.front
        if front is None:
            loss.backward()
            begin = time.thread_time()
            self.optimizer.step()
        else:
            front.scale(loss).backward()
            begin = time.thread_time()
            if self.clip:
                front.unscale_(self.optimizer)
                clip = getattr(front, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
                clip(self.model.parameters(), 1.0)
            front.step(self.optimizer)
            front.update()
        self.section = time.thread_time() - begin
        self.steps += 1

    def drain(self) -> None:
        """Wait until the telemetry thread has built every record so far."""
        if not self.expect_records:
            return
        deadline = time.monotonic() + 60
        while self.records.count < self.steps and time.monotonic() < deadline:
            time.sleep(0.0005)

    def block(self, steps: int) -> tuple[list[float], float, list[float]]:
        """``steps`` iterations: the training thread's CPU seconds of each, every other
        thread's CPU seconds over the block (the telemetry thread drained), and each
        iteration's :attr:`section`."""
        own: list[float] = []
        sections: list[float] = []
        start_all, start_own = time.process_time(), time.thread_time()
        for _ in range(steps):
            begin = time.thread_time()
            self.iteration()
            own.append(time.thread_time() - begin)
            sections.append(self.section)
        self.drain()
        others = (time.process_time() - start_all) - (time.thread_time() - start_own)
        return own, others, sections

    def close(self) -> None:
        close = getattr(self.front, "close", None)
        if close is not None:
            close()


def compare(setup: str, size: int, *, groups: int, steps: int) -> dict[str, Any]:
    """ampscope minus stock, per iteration, in µs of CPU (median over block groups)."""
    contenders = {"stock": Contender(setup, size, False), "ampscope": Contender(setup, size, True)}
    try:
        for contender in contenders.values():  # warm-up: identity, thread start, caches
            contender.block(steps)
        training: list[float] = []
        others: list[float] = []
        section: list[float] = []
        base = {"training": [], "others": [], "section": []}  # type: dict[str, list[float]]
        for group in range(groups):
            per: dict[str, tuple[float, float, float]] = {}
            for name in interleaved_order(group, list(contenders)):
                own, rest, sections = contenders[name].block(steps)
                per[name] = (statistics.median(own), rest / steps, statistics.median(sections))
            training.append(per["ampscope"][0] - per["stock"][0])
            others.append(per["ampscope"][1] - per["stock"][1])
            section.append(per["ampscope"][2] - per["stock"][2])
            base["training"].append(per["stock"][0])
            base["others"].append(per["stock"][1])
            base["section"].append(per["stock"][2])
        tensors = sum(1 for _ in contenders["stock"].model.parameters())
        return {
            "setup": setup,
            "size": size,
            "tensors": tensors,
            "stock_training_us": statistics.median(base["training"]) * 1e6,
            "stock_others_us": statistics.median(base["others"]) * 1e6,
            "training_us": statistics.median(training) * 1e6,
            "training_iqr_us": _iqr(training) * 1e6,
            "others_us": statistics.median(others) * 1e6,
            "others_iqr_us": _iqr(others) * 1e6,
            "stock_section_us": statistics.median(base["section"]) * 1e6,
            "section_us": statistics.median(section) * 1e6,
            "section_iqr_us": _iqr(section) * 1e6,
            "groups": groups,
            "steps_per_block": steps,
        }
    finally:
        for contender in contenders.values():
            contender.close()


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return math.nan
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


@contextlib.contextmanager
def _one_rank_group() -> Any:
    """A 1-rank gloo process group for DDP, torn down after."""
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fp8_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:
        return False
    return True


def run(setups: tuple[str, ...], sizes: tuple[int, ...], groups: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with _one_rank_group():
        for setup in setups:
            if setup == "fp8" and not _fp8_available():
                print("fp8: torchao missing, skipped", flush=True)
                continue
            for size in sizes:
                row = compare(setup, size, groups=groups, steps=steps)
                rows.append(row)
                print(
                    f"{setup:7s} {row['tensors']:4d} tensors: training {row['training_us']:+8.1f}"
                    f" µs (IQR {row['training_iqr_us']:.1f}), others {row['others_us']:+8.1f} µs"
                    f" (IQR {row['others_iqr_us']:.1f}); after backward {row['section_us']:+8.1f}"
                    f" µs (IQR {row['section_iqr_us']:.1f}); stock {row['stock_training_us']:.0f}"
                    f" µs, after backward {row['stock_section_us']:.0f} µs",
                    flush=True,
                )
    return rows


def growth(rows: list[dict]) -> list[dict]:
    """Per setup, µs per extra tensor between the two sizes."""
    out = []
    for setup in SETUPS:
        pair = {row["size"]: row for row in rows if row["setup"] == setup}
        if len(pair) != 2:
            continue
        small, large = pair[SIZES[0]], pair[SIZES[1]]
        extra = large["tensors"] - small["tensors"]
        out.append(
            {
                "setup": setup,
                "training_us_per_tensor": (large["training_us"] - small["training_us"]) / extra,
                "others_us_per_tensor": (large["others_us"] - small["others_us"]) / extra,
            }
        )
    return out


def instructions(setup: str, size: int, name: str, steps: int) -> None:
    """One contender's loop with callgrind counting on around ``steps`` iterations."""
    import subprocess

    torch.set_num_threads(1)
    with _one_rank_group():
        contender = Contender(setup, size, name == "ampscope")
        contender.block(30)

        def instrument(on: bool) -> None:
            subprocess.run(
                ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                check=True,
                capture_output=True,
            )

        instrument(True)
        contender.block(steps)
        instrument(False)
        contender.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_growth", description=__doc__)
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--sizes", nargs="*", type=int, default=list(SIZES), choices=SIZES)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="iterations per block")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--label", default="", help="stored with the figures (e.g. before)")
    parser.add_argument("--instructions", nargs=3, metavar=("SETUP", "SIZE", "NAME"))
    args = parser.parse_args(argv)
    if args.instructions:
        setup, size, name = args.instructions
        instructions(setup, int(size), name, args.steps)
        return
    rows = run(tuple(args.setups), tuple(args.sizes), args.groups, args.steps)
    result = {"label": args.label, "rows": rows, "growth": growth(rows)}
    for item in result["growth"]:
        print(
            f"{item['setup']:7s} growth: training {item['training_us_per_tensor']:+.2f} µs/tensor,"
            f" others {item['others_us_per_tensor']:+.2f} µs/tensor"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
