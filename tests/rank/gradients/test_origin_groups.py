"""The origin group each data-parallel wrapper names: the ranks holding the same parameters.

One 4-rank gloo launch (a launch costs seconds) attaches a ``GradWatch`` with origin
tracking to each layout and reads the group from the handle and from the records' setup:
DDP over pipeline-style data-parallel groups ({0, 1} and {2, 3}, and groups of one),
FSDP1 over the world, FSDP2 over the world, HSDP on a 2 x 2 replicate x shard mesh (its
norm is of the unsharded gradient, so all four are replicas) and FSDP2 on the ``dp``
dimension of a dp x tp mesh (the tp ranks hold other shards: {0, 2} and {1, 3}).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import run_distributed
from torch import nn

from ampscope.reporter.schema import OriginGroup

pytestmark = pytest.mark.distributed


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _group(model: nn.Module, rank: int) -> tuple[list[int], list[OriginGroup | None]]:
    """Attach a watch with origin tracking, train two steps; the handle's ranks (sorted)
    and the records' origin groups."""
    import ampscope

    watch = ampscope.GradWatch("skip", reporter=None, run_id="origin-groups")
    watch.attach(model, track_origin=True)
    (handle,) = watch._ampscope_origin_handles
    ranks = sorted(handle.ranks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        watch.scale(model(x).sum()).backward()
        watch.step(optimizer)
        watch.update()
        optimizer.zero_grad(set_to_none=True)
    groups = [record.setup.origin_group for record in watch.telemetry.history()]
    watch.close()
    return ranks, groups


def _layouts(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(world_size)]
    out = {
        "ddp_pairs": _group(DDP(_net(), process_group=pairs[rank // 2]), rank),
        "ddp_alone": _group(DDP(_net(), process_group=alone[rank]), rank),
        "fsdp1": _group(FSDP(_net(), device_id=torch.device("cpu")), rank),
    }
    fully = _net()
    fully_shard(fully, mesh=init_device_mesh("cpu", (world_size,)))
    out["fully_shard"] = _group(fully, rank)
    hsdp = _net()
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    out["hsdp"] = _group(hsdp, rank)
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    on_dp = _net()
    fully_shard(on_dp, mesh=dp_tp["dp"])
    out["dp_of_dp_tp"] = _group(on_dp, rank)
    return out


def test_each_wrapper_names_its_data_parallel_replicas() -> None:
    results = run_distributed(_layouts, 4)
    for rank, out in enumerate(results):
        expected = {
            "ddp_pairs": [2 * (rank // 2), 2 * (rank // 2) + 1],
            "ddp_alone": [rank],
            "fsdp1": [0, 1, 2, 3],
            "fully_shard": [0, 1, 2, 3],
            "hsdp": [0, 1, 2, 3],
            "dp_of_dp_tp": [rank % 2, rank % 2 + 2],
        }
        for name, ranks in expected.items():
            handle_ranks, groups = out[name]
            assert handle_ranks == ranks, (rank, name)
            group = OriginGroup(first=ranks[0], size=len(ranks))
            assert groups == [group, group], (rank, name)
