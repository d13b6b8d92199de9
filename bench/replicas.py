"""What the replica check costs: step time with checks against the same run without.

``python -m bench.replicas`` trains the GPT-shaped CPU model (:mod:`bench.gpt`, ``CPU_SHAPE``:
12 blocks of width 32, 148 parameter tensors) under DDP on two gloo ranks, each with a
``GradWatch``, three ways interleaved block by block (:mod:`bench.ab`): without the check
(``replica_check_every=0``), at the default ``replica_check_every`` and at 1 (every
iteration). Each rank also times the check alone (``ReplicaCheck.after_step()`` with
``every=1``: the fingerprints, the all-gather, the host read). Prints and writes (``--out``)
rank 0's figures: the per-group ratios against the run without checks, the check's median
time, and the share of a step it costs at the default (check time / (N x step time)).

``--gpu`` measures on one CUDA GPU instead (the lead's H200; under 60 s): GPT-2 small
(:data:`bench.gpt.GPT2_SMALL`, 124M parameters in 148 tensors), bf16 autocast, fused AdamW,
each step timed by CUDA events; the check's device part (the fingerprints of every
parameter and their host read, what a check adds but for the all-gather of 8 bytes per
chunk) timed the same way. One process, no collective: the share at the default is
(fingerprint time / (N x step time)).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.ab import compare_groups, run_interleaved
from bench.gpt import GPT2_SMALL, GPTShape, batch, build_gpt, parameter_count

CPU_SHAPE = GPTShape(layers=12, heads=2, width=32, vocab=256, context=32, batch=4)
"""The GPT-shaped CPU bench model: 148 parameter tensors, steps of a few milliseconds."""

log = logging.getLogger("bench.replicas")


def _cpu_rank(rank: int, world: int, port: int, groups: int, steps: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch import nn

    from ampscope import GradWatch
    from ampscope.rank.config import DEFAULT_REPLICA_CHECK_EVERY
    from ampscope.rank.replicas.check import ReplicaCheck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.parallel.DistributedDataParallel(build_gpt(CPU_SHAPE))
        tokens, targets = batch(CPU_SHAPE, "cpu", seed=rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fronts = {}
        for name, every in (("off", 0), ("default", DEFAULT_REPLICA_CHECK_EVERY), ("every", 1)):
            watch = GradWatch(reporter=None, stats=False)
            watch.attach(model, replica_check_every=every)
            fronts[name] = watch

        def step(watch: GradWatch) -> None:
            opt.zero_grad()
            watch.scale(model(tokens, targets)).backward()
            watch.step(opt)
            watch.update()

        def block(watch: GradWatch) -> list[float]:
            times = []
            for _ in range(steps):
                dist.barrier()  # both ranks start each step together: a step, not a wait
                start = time.perf_counter()
                step(watch)
                times.append(time.perf_counter() - start)
            return times

        for watch in fronts.values():  # warm-up
            for _ in range(3):
                step(watch)
        blocks = run_interleaved(fronts, block, groups=groups)
        check = ReplicaCheck(model, 1)
        alone = []
        for _ in range(groups * steps):
            dist.barrier()
            start = time.perf_counter()
            outcome = check.after_step()
            alone.append(time.perf_counter() - start)
            assert outcome is not None
            assert outcome.agree
        for watch in fronts.values():
            watch.close()
        if rank == 0:
            queue.put(
                {
                    "compare": compare_groups(blocks, baseline="off"),
                    "check_ms": statistics.median(alone) * 1e3,
                    "step_ms": statistics.median(s for b in blocks["off"] for s in b) * 1e3,
                    "parameters": parameter_count(model),
                    "tensors": len(list(model.parameters())),
                    "every": DEFAULT_REPLICA_CHECK_EVERY,
                }
            )
    finally:
        dist.destroy_process_group()


def run_cpu(groups: int, steps: int) -> dict[str, Any]:
    """Two gloo ranks (DDP) on this machine; rank 0's figures."""
    import torch.multiprocessing as mp

    from bench.servers import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_cpu_rank, args=(r, 2, port, groups, steps, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    result["share_at_default"] = result["check_ms"] / (result["every"] * result["step_ms"])
    result["share_every_iteration"] = result["check_ms"] / result["step_ms"]
    result["shape"] = CPU_SHAPE.as_dict()
    result["device"] = "cpu"
    return result


def run_gpu(steps: int) -> dict[str, Any]:
    """One CUDA GPU: GPT-2 small's step against the check's device part."""
    from ampscope.rank.config import DEFAULT_REPLICA_CHECK_EVERY
    from ampscope.rank.replicas.fingerprint import FingerprintPlan, Piece

    device = torch.device("cuda")
    model = build_gpt(GPT2_SMALL).to(device)
    tokens, targets = batch(GPT2_SMALL, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    plan = FingerprintPlan([Piece(n, p, 0, p.numel()) for n, p in model.named_parameters()])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()

    def timed(fn: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        return out

    for _ in range(5):
        step()
    plan.chunks().cpu()
    step_ms = statistics.median(timed(step, steps))
    check_ms = statistics.median(timed(lambda: plan.chunks().cpu(), steps))
    return {
        "device": torch.cuda.get_device_name(0),
        "parameters": parameter_count(model),
        "tensors": len(list(model.parameters())),
        "step_ms": step_ms,
        "check_ms": check_ms,
        "every": DEFAULT_REPLICA_CHECK_EVERY,
        "share_at_default": check_ms / (DEFAULT_REPLICA_CHECK_EVERY * step_ms),
        "share_every_iteration": check_ms / step_ms,
        "fingerprints": plan.size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, GPT-2 small")
    parser.add_argument("--groups", type=int, default=6, help="interleaved block groups (CPU)")
    parser.add_argument("--steps", type=int, default=30, help="steps per block")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    result = run_gpu(args.steps) if args.gpu else run_cpu(args.groups, args.steps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
