"""A torchrun worker whose rank 1 fails once (see test_stopped_ranks.py).

Two gloo ranks, each with ``ampscope.GradScaler("cpu")`` and the default reporter
(``AMPSCOPE_URL``, ``AMPSCOPE_RUN_ID``), all-reduce once, then:

* first generation (``TORCHELASTIC_RESTART_COUNT=0``): rank 1 takes 3 steps and dies on an
  uncaught ``RuntimeError``; rank 0 keeps taking steps (a local phase: no collective, back
  in the interpreter every step), until torchrun's agent stops it with SIGTERM to restart
  the group;
* second generation: each rank waits until the file ``ELASTIC_GO`` exists (the test creates
  it once it read the first generation's end on the exporter), takes 3 steps and exits
  normally.
"""

from __future__ import annotations

import faulthandler
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ampscope

GO_WAIT_S = 120.0
"""A deadlock guard: the test creates the go file as soon as it read the exporter."""

HANG_GUARD_S = 180.0
"""A deadlock guard for the whole process: past it, every thread's stack goes to stderr
(torchrun's log) and the process exits, so a hang names itself."""


def _step(scaler: ampscope.GradScaler, model: torch.nn.Module, optimizer: torch.optim.SGD) -> None:
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def main() -> None:
    faulthandler.dump_traceback_later(HANG_GUARD_S, exit=True)
    generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if generation > 0:
        go = Path(os.environ["ELASTIC_GO"])
        deadline = time.monotonic() + GO_WAIT_S
        while not go.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{go} did not appear within {GO_WAIT_S:.0f}s")
            time.sleep(0.05)
    # torchrun's agent keeps its store across restarts: under a prefix of its own, the new
    # generation never reads the gloo addresses the dead one published there (which made
    # its connectFullMesh wait on a refused port, now and then, on this torch).
    store, rank, world_size = next(dist.rendezvous("env://"))
    prefixed = dist.PrefixStore(f"generation-{generation}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscope.GradScaler("cpu")
    dist.all_reduce(torch.ones(1))
    for _ in range(3):
        _step(scaler, model, optimizer)
    if generation > 0:
        scaler.close()
        dist.destroy_process_group()
        return
    if rank == 1:
        raise RuntimeError("worker 1 fails once")
    while True:  # until the agent's SIGTERM
        _step(scaler, model, optimizer)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
