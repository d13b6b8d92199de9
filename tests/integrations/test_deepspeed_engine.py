"""The DeepSpeed engine reads of the replica check (``_deepspeed_engine``), without
DeepSpeed: which parameters a data-parallel rank holds whole, and over which group. The
real engines (ZeRO 0-3, 2 gloo ranks) are in tests/integrations/test_deepspeed.py."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from ampscope.integrations._deepspeed_engine import replicated_parameters, zero_stage


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
