"""The DeepSpeed integration's own-gradient hooks (``OwnGradientFlags``), without DeepSpeed:
they are plain tensor hooks, so a plain model's backward exercises them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampscope.integrations._deepspeed_hooks import OwnGradientFlags


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _poison(param: nn.Parameter) -> None:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad

    param.register_hook(hook)  # registered first: runs before the flags' hook


def test_a_clean_backward_flags_nothing() -> None:
    model = _model()
    flags = OwnGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward()
    assert flags.take() == ({"cpu": False}, {})


def test_a_nan_in_one_gradient_names_its_parameter_over_micro_batches() -> None:
    model = _model()
    _poison(model[1].weight)
    flags = OwnGradientFlags(model.named_parameters())
    for _ in range(2):  # accumulation: the flag of the first micro-batch is kept
        model(torch.randn(3, 4)).square().mean().backward()
    assert flags.take() == ({"cpu": True}, {"1.weight": 1})
    assert flags.take() == ({"cpu": False}, {}), "take() starts afresh"


@pytest.mark.parametrize("create_graph", [False, True])
def test_the_check_is_not_recorded_even_when_backward_builds_a_graph(
    create_graph: bool,
) -> None:
    """The hook runs its check without ``no_grad`` (which would cost as much as the kernel):
    with ``create_graph=True`` the check must still flag, record nothing into the
    gradients' graph, and leave that graph differentiable."""
    model = _model()
    _poison(model[0].bias)
    flags = OwnGradientFlags(model.named_parameters())
    model(torch.randn(3, 4)).square().mean().backward(create_graph=create_graph)
    recorded = [
        node.name()
        for p in model.parameters()
        if p.grad is not None and p.grad.grad_fn is not None
        for node in [p.grad.grad_fn]
    ]
    assert not any("amp" in name.lower() for name in recorded), recorded
    assert flags.take() == ({"cpu": True}, {"0.bias": 1})
    assert flags.errors == 0
    if create_graph:
        weight = model[1].weight
        assert weight.grad is not None
        assert weight.grad.requires_grad
        weight.grad.sum().backward()  # the gradient's own graph still differentiates


def test_a_non_contiguous_gradient_is_read_not_written() -> None:
    param = nn.Parameter(torch.ones(3, 4))
    flags = OwnGradientFlags([("p", param)])
    grad = torch.full((4, 3), math.inf).t()  # not contiguous
    param.grad = None
    (param * 1.0).backward(grad)
    assert flags.take() == ({"cpu": True}, {"p": 1})
