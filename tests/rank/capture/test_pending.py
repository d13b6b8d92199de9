"""A pending step's one host copy: the values, the stats' norms and a front-end's extra
values travel together and are read back apart (CPU tensors take the device path's code)."""

from __future__ import annotations

import torch

from ampscope.rank.capture import layout
from ampscope.rank.capture.pending import PendingStep, copy_with_norms
from ampscope.rank.gradients.stats import OptimizerNorms, TakenStats
from ampscope.reporter.schema import Identity

IDENTITY = Identity(run="run-a", node="n0", rank=0, local_rank=0, world_size=1)


def _pending(extra: torch.Tensor | None) -> PendingStep:
    pending = PendingStep(IDENTITY, 1, 0.0, False)
    pending.extra = extra
    return pending


def _copied(pending: PendingStep, values: torch.Tensor, stats: TakenStats | None) -> None:
    pending.host, pending.ready = copy_with_norms(pending, values, stats)


VALUES = torch.tensor(layout.head(8.0, []) + layout.tail(8.0, 2.0, []))


def test_extra_values_follow_the_norms_in_the_same_copy() -> None:
    norms = (torch.tensor(3.0), torch.tensor(4.0))
    stats = TakenStats(None, 0, (OptimizerNorms(("a", "b"), norms, False, None),), {})
    pending = _pending(torch.tensor([0.5, 7.0, 0.25], dtype=torch.float64))
    _copied(pending, VALUES, stats)
    assert pending.host is not None
    assert len(pending.host) == len(VALUES) + 2 + 3  # one copy holds all three parts
    assert pending.read() == [8.0, 8.0, 2.0]
    assert pending.host_norms is not None
    assert pending.host_norms.tolist() == [3.0, 4.0]
    assert pending.read_extra() == [0.5, 7.0, 0.25]  # cast to float32, exact here


def test_extra_values_without_norms() -> None:
    pending = _pending(torch.tensor([1.5]))
    _copied(pending, VALUES, None)
    assert pending.host_norms is None
    assert pending.read() == [8.0, 8.0, 2.0]
    assert pending.read_extra() == [1.5]


def test_no_extra_values() -> None:
    pending = _pending(None)
    _copied(pending, VALUES, None)
    assert pending.host_extra is None
    assert (pending.read(), pending.read_extra()) == ([8.0, 8.0, 2.0], [])


def test_the_host_transport_reads_extra_as_it_is() -> None:
    pending = _pending(torch.tensor([2.0, 3.0]))
    pending.values = [8.0, 8.0, 2.0]
    assert pending.read() == [8.0, 8.0, 2.0]
    assert pending.read_extra() == [2.0, 3.0]
