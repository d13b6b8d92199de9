"""Which parameters a replica set compares (the 4-rank runs are in
tests/integration/test_replica_divergence.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn

from ampscope.rank.replicas.groups import _ddp_set


@pytest.fixture
def one_rank_gloo() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_leaves_out_the_parameters_ddp_was_told_to_ignore(one_rank_gloo: None) -> None:
    """Parameters DDP does not synchronise (model-parallel parts) differ by design: comparing
    them would call a healthy run's replicas diverged."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["1.weight"]
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    names = [piece.name for piece in _ddp_set(ddp).pieces]
    assert names == ["0.weight", "0.bias", "1.bias"]
