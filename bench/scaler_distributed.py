"""Scaler overhead across ranks: DDP on gloo (CPU) or NCCL (CUDA), spawned processes.

Three contenders, each its own DDP copy of the same model, interleaved block by block:
torch's stock scaler, ampscope with its HTTP reporter, and ampscope with origin tracking
as well (``scaler.attach(model, track_origin=True)``: a DDP comm hook checks each rank's
unreduced gradient buckets). Every rank runs the same sequence, so their collectives
match; a barrier starts each block. A step's time is the slowest rank's.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any

from bench.ab import compare_groups, interleaved_order
from bench.config import ScalerBenchConfig
from bench.servers import free_port


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    config: ScalerBenchConfig,
    device: str,
    url: str,
    results: Any,
) -> None:
    """One rank: time every contender's blocks and send the step times back."""
    try:
        results.put((rank, "ok", _rank_body(rank, world_size, port, config, device, url)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _rank_body(
    rank: int, world_size: int, port: int, config: ScalerBenchConfig, device: str, url: str
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bench.scaler_single import autocast_dtype
    from bench.workload import (
        ampscope_scaler,
        build_model,
        make_variant,
        stock_scaler,
        train_step,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One intra-op thread per rank: ranks share the host's cores, and a fixed thread
    # count keeps step times comparable between contenders.
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size
    )
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        model = build_model(width=config.width, depth=config.depth).to(dev)
        device_ids = [rank] if device == "cuda" else None

        def ddp(m: torch.nn.Module) -> torch.nn.Module:
            return DistributedDataParallel(m, device_ids=device_ids)

        variants = [
            make_variant("stock", model, stock_scaler(device), wrap=ddp),
            make_variant(
                "ampscope", model, ampscope_scaler(device, url=url, run_id="bench-ddp"), wrap=ddp
            ),
            make_variant(
                "ampscope_origin",
                model,
                ampscope_scaler(device, url=url, run_id="bench-ddp-origin"),
                wrap=ddp,
            ),
        ]
        variants[1].scaler.attach(variants[1].model)
        variants[2].scaler.attach(variants[2].model, track_origin=True)
        torch.manual_seed(1 + rank)  # each rank its own data, as in data parallelism
        inputs = torch.randn(config.batch, config.width, device=dev)
        targets = torch.randn(config.batch, config.width, device=dev)
        dtype = autocast_dtype(device)
        by_name = {v.name: v for v in variants}
        times: dict[str, list[list[float]]] = {name: [] for name in by_name}
        try:
            for v in variants:
                for _ in range(config.warmup_steps):
                    train_step(v, inputs, targets, autocast_dtype=dtype)
            for group in range(config.groups):
                for name in interleaved_order(group, list(by_name)):
                    dist.barrier()
                    times[name].append(
                        [
                            train_step(by_name[name], inputs, targets, autocast_dtype=dtype)
                            for _ in range(config.steps_per_block)
                        ]
                    )
        finally:
            for v in variants:
                v.close()
        return {"times": times}
    finally:
        dist.destroy_process_group()


def run_distributed_bench(
    config: ScalerBenchConfig, *, device: str, url: str, timeout: float = 600.0
) -> dict[str, Any]:
    """Spawn the ranks, gather their step times, compare contenders on the slowest rank.

    World size: ``config.world_size`` on CPU (gloo); 1 on CUDA (NCCL, one GPU assumed).
    Cost: process start-up (a few seconds) plus ``3 * groups * steps_per_block`` steps.
    """
    import torch.multiprocessing as mp

    world_size = 1 if device == "cuda" else config.world_size
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, config, device, url, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    per_rank: dict[int, dict[str, list[list[float]]]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(per_rank) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank killed outright (or failing to start) never reports: notice it
                # instead of waiting out the whole timeout.
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ranks did not report (exit codes {[p.exitcode for p in procs]}, "
                        f"{len(per_rank)}/{world_size} results)"
                    ) from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            per_rank[rank] = value["times"]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # A synchronous data-parallel step takes as long as its slowest rank.
    blocks = {
        name: [
            [max(steps) for steps in zip(*(per_rank[r][name][g] for r in per_rank), strict=True)]
            for g in range(config.groups)
        ]
        for name in per_rank[0]
    }
    result = compare_groups(blocks, baseline="stock")
    origin = blocks["ampscope_origin"]
    plain = blocks["ampscope"]
    origin_vs_plain = compare_groups(
        {"ampscope": plain, "ampscope_origin": origin}, baseline="ampscope"
    )
    result["origin_vs_ampscope"] = origin_vs_plain["ratio"]["ampscope_origin"]
    result["world_size"] = world_size
    # Two contenders report, on every rank.
    result["reported_updates"] = (
        2 * world_size * (config.warmup_steps + config.groups * config.steps_per_block)
    )
    result["backend"] = "nccl" if device == "cuda" else "gloo"
    result["wrapper"] = "DistributedDataParallel"
    return result
