"""What origin tracking's check costs per gradient bucket, on the CPU.

``python -m bench.origin_marks`` marks ``--buckets`` buckets of ``--numel`` float32
elements into an :class:`~ampscope.rank.gradients.origin.OriginFlags` (with norms, as the
scalers use it) and takes the flags and squared norms, as one iteration does. It prints the
torch ops one mark issues and one take issues (torch's profiler, top-level ops: on a GPU
each launches a kernel, views aside), and the CPU time of one iteration (best of
``--rounds`` rounds). Small buckets, so the per-bucket work shows rather than the reads.
Compare two trees with ``PYTHONPATH=TREE`` from a directory without an ``ampscope/``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ampscope.rank.gradients.origin import OriginFlags


def _top_level_ops(run: Callable[[], object]) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return [event.name for event in prof.events() if event.cpu_parent is None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, default=20)
    parser.add_argument("--numel", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    flags = OriginFlags(norms=True)
    buckets = [torch.randn(args.numel) for _ in range(args.buckets)]

    def iteration() -> None:
        for bucket in buckets:
            flags.mark(bucket)
        flags.take()
        flags.take_squares()

    for _ in range(10):  # warm-up: buffers, caches
        iteration()

    def marks_only() -> None:
        for bucket in buckets:
            flags.mark(bucket)

    marks = _top_level_ops(marks_only)
    takes = _top_level_ops(lambda: (flags.take(), flags.take_squares()))
    best = float("inf")
    for _ in range(args.rounds):
        start = time.process_time()
        for _ in range(50):
            iteration()
        best = min(best, (time.process_time() - start) / 50)
    print(f"ops per mark: {len(marks) / args.buckets:g} ({', '.join(sorted(set(marks)))})")
    print(f"ops per take: {len(takes)}")
    print(f"{args.buckets} buckets of {args.numel}: {best * 1e6:.0f} us of CPU per iteration")


if __name__ == "__main__":
    main()
