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


def test_a_model_the_check_cannot_lay_out_is_attached_without_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model the check refuses (several DDP wrappers in one container, a GAN's two
    models, on several ranks): attach() goes on without the replica check, as it did
    before the check existed, and says so."""
    import ampscope
    from ampscope.rank.replicas import check

    def refuse(self: object, model: nn.Module, every: int) -> None:
        raise ValueError("the model holds several DDP wrappers")

    monkeypatch.setattr(check.ReplicaCheck, "__init__", refuse)
    watch = ampscope.GradWatch("observe", reporter=None)
    model = nn.Linear(4, 4)
    with caplog.at_level("WARNING", logger="ampscope"):
        watch.attach(model, replica_check_every=1)
    assert watch._ampscope_replicas is None
    assert "replica check off" in caplog.text
    assert watch._ampscope_names._lookup(model.weight) == "weight"  # the rest stood
    watch.close()
