"""The DeepSpeed engine reads (``deepspeed.engine``, ``deepspeed.step_reads``), without
DeepSpeed: which parameters a data-parallel rank holds whole, and over which group; the
growth tracker; a step's values read on the telemetry thread, none on the training thread.
The real engines (ZeRO 0-3, 2 gloo ranks) are in tests/integrations/test_deepspeed.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from support import HostReads
from torch import nn

from ampscope.integrations.deepspeed import engine as ds
from ampscope.integrations.deepspeed.engine import replicated_parameters, zero_stage
from ampscope.integrations.deepspeed.origin import BoundaryGradientFlags
from ampscope.integrations.deepspeed.step_reads import StepReads


def _engine(**experts: object) -> SimpleNamespace:
    return SimpleNamespace(
        seq_data_parallel_group="dp",
        expert_data_parallel_group=experts,
        zero_optimization_stage=lambda: 2,
    )


def test_dense_parameters_are_held_whole_by_the_data_parallel_group() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    got = [(name, group) for name, _, group in replicated_parameters(_engine(), model)]
    assert got == [("0.weight", "dp"), ("0.bias", "dp"), ("1.weight", "dp"), ("1.bias", "dp")]
    assert zero_stage(_engine()) == 2


def test_experts_compare_over_their_expert_group_and_partitions_not_at_all() -> None:
    """As DeepSpeed's ``_broadcast_model`` sees them: an MoE expert is replicated over its
    expert data-parallel group; a ZeRO-3 partition (``ds_status``), an ``OptimizedLinear``
    shard (``ds_optim_param``) and an expert of an unknown group are nobody's replica."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    expert = model[1]
    for param in expert.parameters():
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = "ep_size_2"  # type: ignore[attr-defined]
    model[0].weight.ds_status = "NOT_AVAILABLE"  # type: ignore[attr-defined]
    model[0].bias.ds_optim_param = True  # type: ignore[attr-defined]
    model[3].weight.allreduce = False  # type: ignore[attr-defined]
    model[3].weight.group_name = "ep_size_4"  # type: ignore[attr-defined]
    engine = _engine(ep_size_2="edp2")
    got = [(name, group) for name, _, group in replicated_parameters(engine, model)]
    assert got == [
        ("1.weight", "edp2"),
        ("1.bias", "edp2"),
        ("2.weight", "dp"),
        ("2.bias", "dp"),
        ("3.bias", "dp"),
    ]


class _Scaler:
    """DeepSpeed's dynamic fp16 loss scaler's counters."""

    cur_iter, last_overflow_iter, scale_window = 5, 2, 4


def _fp16_engine(optimizer: object) -> SimpleNamespace:
    return SimpleNamespace(
        optimizer=optimizer,
        fp16_enabled=lambda: True,
        was_step_applied=lambda: True,
        get_global_grad_norm=lambda: torch.tensor(3.0, dtype=torch.float64),
    )


def test_the_growth_tracker_counts_from_counters_read_at_the_step() -> None:
    engine = _fp16_engine(SimpleNamespace(loss_scaler=_Scaler(), cur_scale=8.0))
    counters = ds.scaler_counters(engine)
    assert counters == (5, 2, 4)
    # Two clean update()s since the overflow at iteration 2, within a window of 4.
    assert ds.growth_tracker(counters, False, 8.0, 8.0) == 2
    assert ds.growth_tracker(counters, True, 8.0, 4.0) == 0
    assert ds.growth_tracker(counters, False, 8.0, 16.0) == 0
    assert ds.growth_tracker(None, False, 8.0, 8.0) == 1, "a static scale"


def test_the_step_reads_nothing_on_the_host_until_the_telemetry_thread_does() -> None:
    """StepReads (training thread) reads DeepSpeed's host state and leaves the norm tensor,
    the flags and the loss unread; read() decodes them exactly (float64 on the way)."""
    engine = _fp16_engine(SimpleNamespace(overflow=False, cur_scale=8.0))
    model = nn.Linear(2, 1)
    flags = BoundaryGradientFlags(model.named_parameters())
    model(torch.tensor([[math.nan, 1.0]])).sum().backward()
    flags.check()
    loss = torch.tensor(0.1, dtype=torch.float32)
    with HostReads() as census:
        reads = StepReads(engine, 16.0, flags, None, loss, torch.device("cpu"))
    assert census.count == 0
    step = reads.read()
    assert (step.overflow, step.applied, step.before, step.after) == (False, True, 16.0, 8.0)
    assert step.norm == 3.0
    assert step.loss == loss.item()
    assert step.origin == {"cpu": True}
    assert step.named == {"weight": 1}
    assert not step.reduced


def test_only_an_engine_without_overflow_norm_or_scaler_lacks_a_global_verdict() -> None:
    def engine(optimizer: object, fp16: bool = False) -> SimpleNamespace:
        return SimpleNamespace(optimizer=optimizer, fp16_enabled=lambda: fp16)

    assert not ds.gives_global_verdict(engine(torch.optim.SGD(nn.Linear(1, 1).parameters())))
    assert ds.gives_global_verdict(engine(SimpleNamespace(overflow=False)))
    assert ds.gives_global_verdict(engine(SimpleNamespace(_global_grad_norm=None)))
    assert ds.gives_global_verdict(engine(SimpleNamespace(), fp16=True))
