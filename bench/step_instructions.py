"""Instructions per iteration on the training thread, counted by valgrind's callgrind.

Instruction counts do not move with other load on a shared host, so two runs of this
script (``stock`` and ``ampscope``) give ampscope's extra work per iteration where wall
and CPU clocks cannot resolve a few microseconds. Run it under callgrind with
instrumentation off at start; the script turns it on around the measured steps only::

    valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        --callgrind-out-file=/tmp/cg/stock.out python -m bench.step_instructions stock 200
    valgrind ... --callgrind-out-file=/tmp/cg/ampscope.out \\
        python -m bench.step_instructions ampscope 200

``watch-observe`` and ``watch-skip`` run a ``GradWatch`` in the same loop instead. Thread
1's file (``*.out-01``) is the training thread: (ampscope total - stock total) / steps is
the extra instructions per iteration; ``callgrind_annotate`` on the two files
says where they go. The telemetry thread's file holds the record-building work.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import torch
from torch import nn

from bench.workload import ampscope_scaler, make_variant, stock_scaler


def instrument(on: bool) -> None:
    """Turn callgrind's counting on or off for this process."""
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
        check=True,
        capture_output=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scaler", choices=("stock", "ampscope", "watch-observe", "watch-skip"))
    parser.add_argument("steps", type=int, nargs="?", default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    inputs = torch.randn(4, 16)
    if args.scaler == "stock":
        variant = make_variant(args.scaler, model, stock_scaler("cpu"))
    elif args.scaler.startswith("watch-"):
        # A GradWatch in the same loop (fp32, no scale): the watch's own work per iteration.
        import ampscope

        policy = args.scaler.removeprefix("watch-")
        watch = ampscope.GradWatch(policy, reporter=None, run_id="bench-instructions")
        variant = make_variant(args.scaler, model, watch)
        watch.attach(variant.model)
    else:
        scaler = ampscope_scaler("cpu", url=None, run_id="bench-instructions")
        variant = make_variant(args.scaler, model, scaler)
        scaler.attach(variant.model)

    def loop(steps: int) -> None:
        for _ in range(steps):
            variant.optimizer.zero_grad(set_to_none=True)
            variant.scaler.scale(variant.model(inputs).square().mean()).backward()
            variant.scaler.step(variant.optimizer)
            variant.scaler.update()

    loop(50)  # warm-up: the first update() resolves the identity, starts the thread
    instrument(True)
    loop(args.steps)
    instrument(False)
    variant.close()


if __name__ == "__main__":
    main()
