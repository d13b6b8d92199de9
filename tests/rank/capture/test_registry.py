"""One registry of optimizers and shared step parts, for the scalers' and the watch's capture."""

from __future__ import annotations

import torch
from torch import nn

from ampscope.rank.capture.registry import CaptureRegistry, grad_dtype
from ampscope.rank.capture.scaler import StepCapture
from ampscope.rank.capture.watch import WatchCapture


def _sgd(*params: nn.Parameter) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=0.1)


def test_optimizers_are_registered_once_and_refreshed_on_a_new_group() -> None:
    registry = CaptureRegistry(mode="watch", policy="observe", count_steps=False)
    first = _sgd(nn.Parameter(torch.zeros(2)))
    second = _sgd(nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))
    info = registry.info(first)
    assert registry.info(first) is info
    assert (info.index, info.name, info.fused, info.handle) == (0, "SGD", False, None)
    assert (info.dtypes, info.place) == (
        frozenset({"float32"}),
        (torch.device("cpu"), torch.float32),
    )
    assert registry.info(second).index == 1
    first.add_param_group({"params": [nn.Parameter(torch.zeros(1, dtype=torch.float64))]})
    assert registry.info(first) is info
    assert (info.groups, info.dtypes, info.place) == (2, frozenset({"float32", "float64"}), None)
    assert registry.known(id(first)) is info
    assert registry.known(id(object())) is None


def test_a_counting_registry_counts_steps_until_closed() -> None:
    registry = CaptureRegistry(mode="scaler", policy="skip", count_steps=True)
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = _sgd(param)
    info = registry.info(optimizer)
    assert info.counted
    optimizer.step()
    optimizer.step()
    assert info.calls == [2]
    registry.close()
    optimizer.step()
    assert info.calls == [2]  # the hook is gone
    assert registry.known(id(optimizer)) is None


def test_shared_parts_are_made_once_per_value() -> None:
    registry = CaptureRegistry(mode="watch", policy="skip", count_steps=False)
    info = registry.info(_sgd(nn.Parameter(torch.zeros(1))))
    slot = registry.slot(info, True, 1)
    assert registry.slot(info, True, 1) is slot
    assert registry.slot(info, False, 1) is not slot
    assert (slot.index, slot.name, slot.fused, slot.stepped, slot.num_flags) == (
        0,
        "SGD",
        False,
        True,
        1,
    )
    unknown = registry.slot(None, True, 2)
    assert (unknown.index, unknown.name, unknown.num_flags) == (0, "unknown", 2)
    cpu = torch.device("cpu")
    names = registry.device_names({cpu: None})
    assert names == ("cpu",)
    assert registry.device_names({cpu: torch.zeros(1)}) is names
    setup = registry.setup(frozenset({"bfloat16", "float32"}))
    assert (setup.mode, setup.policy, setup.grad_dtype) == ("watch", "skip", "bfloat16+float32")
    assert registry.setup(frozenset({"float32", "bfloat16"})) is setup


def test_grad_dtype_names() -> None:
    assert grad_dtype(frozenset()) is None
    assert grad_dtype(frozenset({"float16"})) == "float16"


def test_both_captures_name_their_setups_through_a_registry() -> None:
    step, watch = StepCapture(), WatchCapture("raise")
    assert isinstance(step._registry, CaptureRegistry)
    assert isinstance(watch._registry, CaptureRegistry)
    dtypes = frozenset({"float16"})
    assert (step._registry.setup(dtypes).mode, step._registry.setup(dtypes).policy) == (
        "scaler",
        "skip",
    )
    assert (watch._registry.setup(dtypes).mode, watch._registry.setup(dtypes).policy) == (
        "watch",
        "raise",
    )
