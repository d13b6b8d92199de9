"""One rank of the lifecycle tests, run as its own process: ``python lifecycle_rank.py MODE``.

Reports to ``AMPSCOPE_URL`` under ``AMPSCOPE_RUN_ID`` with the default reporter, as a user's
job would. Modes:

* ``finish``: 12 steps, then a normal interpreter exit (no ``close()``);
* ``collapse``: 20 steps whose gradients always overflow (the scale falls below 1), then exit;
* ``pause SECONDS``: 6 steps, sleep inside the loop, 6 more steps, then exit;
* ``checkpoint``: 6 steps, then, inside ``scaler.paused("checkpoint")``, waits until a line
  (or EOF) arrives on stdin, then 6 more steps and a normal exit;
* ``hang``: 6 steps, then sleep until killed;
* ``idle``: 6 steps, prints ``totals `` and the rank's own cumulative totals as JSON, then
  waits idle until a line (or EOF) arrives on stdin, then exits normally;
* ``gloo RANK CULPRIT_STEP``: 2 gloo ranks (``MASTER_ADDR``/``MASTER_PORT`` set), all-reducing
  the loss every 5 steps; the rank named ``CULPRIT_STEP`` > 0 blocks forever before its step
  of that number, so the other waits in the next all-reduce;
* ``bf16_raise RANK NAN_RANK NAN_STEP``: 2 gloo ranks train a bf16 DDP model under
  ``GradWatch(policy="raise")`` with origin tracking; rank ``NAN_RANK``'s batch holds a NaN
  at step ``NAN_STEP``, so every rank raises ``NonFiniteGradientsError`` there, uncaught;
* ``crash STEPS``: a bf16 ``GradWatch`` (observe) takes ``STEPS`` steps, then the script
  dies on an uncaught ``RuntimeError``;
* ``watch_finish``: the same watch, 6 steps, then a normal exit.

Prints ``ready`` once its first steps are taken.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ampscope


def _train(scaler: ampscope.GradScaler, steps: range, *, poison: bool = False) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in steps:
        optimizer.zero_grad()
        x = torch.randn(8, 4)
        if poison:
            x[0, 0] = float("inf")
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def main(mode: str, *args: str) -> None:
    if mode == "gloo":
        _gloo(int(args[0]), int(args[1]))
        return
    if mode == "bf16_raise":
        _bf16_raise(int(args[0]), int(args[1]), int(args[2]))
        return
    if mode in ("crash", "watch_finish"):
        _watch(int(args[0]) if args else 6, crash=mode == "crash")
        return
    scaler = ampscope.GradScaler("cpu")
    if mode in ("finish", "collapse"):
        _train(scaler, range(20 if mode == "collapse" else 12), poison=mode == "collapse")
        print("ready", flush=True)
    elif mode == "pause":
        _train(scaler, range(6))
        print("ready", flush=True)
        time.sleep(float(args[0]))  # evaluation, a checkpoint, a slow data loader
        _train(scaler, range(6))
    elif mode == "checkpoint":
        _train(scaler, range(6))
        with scaler.paused("checkpoint"):
            print("ready", flush=True)
            sys.stdin.readline()  # a checkpoint save longer than --stall-after
        _train(scaler, range(6))
    elif mode == "idle":
        _train(scaler, range(6))
        last = scaler.telemetry.snapshot().last
        assert last is not None
        print("totals", last.totals.model_dump_json(), flush=True)
        print("ready", flush=True)
        sys.stdin.readline()  # evaluation, a checkpoint, a hang: no update() meanwhile
    elif mode == "hang":
        _train(scaler, range(6))
        print("ready", flush=True)
        time.sleep(3600)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def _gloo(rank: int, culprit_step: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    scaler = ampscope.GradScaler("cpu")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 1000):
        if step == culprit_step:
            print("ready", flush=True)
            time.sleep(3600)  # blocks forever before the next collective
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 5 == 0:
            dist.all_reduce(loss.detach())  # e.g. averaging the loss for logging
        if step == 3 and culprit_step == 0:
            print("ready", flush=True)


def _bf16_raise(rank: int, nan_rank: int, nan_step: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1).to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = ampscope.GradWatch(policy="raise")
    watch.attach(model, track_origin=True)
    for step in range(1, 1000):
        optimizer.zero_grad()
        x = torch.randn(8, 4, dtype=torch.bfloat16)
        if rank == nan_rank and step == nan_step:
            x[0, 0] = float("nan")
        watch.scale(model(x).float().pow(2).mean()).backward()
        watch.step(optimizer)  # raises NonFiniteGradientsError on both ranks at nan_step
        watch.update()
        if step == 2:
            print("ready", flush=True)


def _watch(steps: int, *, crash: bool) -> None:
    model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = ampscope.GradWatch()
    for _ in range(steps):
        optimizer.zero_grad()
        watch.scale(model(torch.randn(8, 4, dtype=torch.bfloat16)).float().pow(2).mean()).backward()
        watch.step(optimizer)
        watch.update()
    print("ready", flush=True)
    if crash:
        raise RuntimeError(f"data loader died after step {steps}")


if __name__ == "__main__":
    os.environ.setdefault("AMPSCOPE_RUN_ID", "lifecycle")
    main(sys.argv[1], *sys.argv[2:])
