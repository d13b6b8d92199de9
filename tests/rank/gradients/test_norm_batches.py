"""NormBatches: the CPU's per-parameter norms in a few ops, against the per-tensor norms."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import repeated_shapes

from ampscope.rank.gradients.norm_batches import NormBatches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_batches_equal_the_per_tensor_norms_in_their_names_order(
    dtype: torch.dtype,
) -> None:
    model = repeated_shapes().to(dtype)
    model(torch.randn(4, 16, dtype=dtype)).float().square().mean().backward()
    params = tuple(model.parameters())
    names = tuple(name for name, _ in model.named_parameters())
    batches = NormBatches(names, params)
    low = dtype.itemsize < 4
    vector = batches.norms([p.grad for p in params], low)  # type: ignore[misc]
    by_name = dict(
        zip(
            names,
            torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32 if low else None),
            strict=True,
        )
    )  # type: ignore[misc]
    assert sorted(batches.names) == sorted(names)
    assert len(batches.gathers) >= 2, "the repeated shapes are stacked"
    assert batches.rest is not None, "the large and unique gradients are normed alone"
    assert vector.dtype == (torch.float32 if low else dtype)
    expected = torch.stack([by_name[name] for name in batches.names])
    # A row may be added in another order than the tensor alone: an ulp at most.
    torch.testing.assert_close(vector, expected, rtol=2.5e-7, atol=0.0)


def test_norm_batches_norm_scalar_parameters() -> None:
    """0-dim parameters (learned scales, a logit scale) stack to a vector: each is its own
    row, its norm its absolute value."""
    scales = [torch.nn.Parameter(torch.tensor(v)) for v in (2.0, -3.0, 0.5)]
    weight = torch.nn.Parameter(torch.randn(4, 4))
    loss = (weight.sum() * scales[0] + scales[1] ** 2 + scales[2] * 3).square()
    loss.backward()
    params = (weight, *scales)
    batches = NormBatches(("w", "s0", "s1", "s2"), params)
    vector = batches.norms([p.grad for p in params], False)  # type: ignore[misc]
    by_name = {
        name: param.grad.norm().item()  # type: ignore[union-attr]
        for name, param in zip(("w", "s0", "s1", "s2"), params, strict=True)
    }
    assert vector.tolist() == pytest.approx([by_name[n] for n in batches.names], rel=1e-6)
    assert batches.gathers, "the scalars are stacked together"


def test_norm_batches_show_an_inf_in_a_stacked_gradient() -> None:
    model = repeated_shapes()
    model(torch.randn(4, 16)).square().mean().backward()
    params = tuple(model.parameters())
    poisoned = params[2]  # "1.weight", the second Linear(16, 16): stacked with its peers
    assert poisoned.grad is not None
    poisoned.grad[3, 4] = math.inf
    names = tuple(name for name, _ in model.named_parameters())
    batches = NormBatches(names, params)
    vector = batches.norms([p.grad for p in params], False)  # type: ignore[misc]
    flagged = [
        name
        for name, norm in zip(batches.names, vector.tolist(), strict=True)
        if not math.isfinite(norm)
    ]
    assert flagged == ["1.weight"]


def test_norm_batches_still_norm_a_gradient_whose_shape_changed() -> None:
    """A parameter's data replaced by one of another shape after the plan was made (an
    embedding resized in place): the batch no longer stacks, and the norms come one by one,
    in the same order, with the same values."""
    model = repeated_shapes()
    params = tuple(model.parameters())
    names = tuple(name for name, _ in model.named_parameters())
    batches = NormBatches(names, params)
    with torch.no_grad():
        params[0].data = torch.randn(16, 8)  # "0.weight", stacked with its peers at planning
    model[0].in_features = 8
    model(torch.randn(4, 8)).square().mean().backward()
    grads = [p.grad for p in params]
    vector = batches.norms(grads, False)  # type: ignore[arg-type]
    by_name = dict(zip(names, torch._foreach_norm(grads), strict=True))  # type: ignore[arg-type]
    assert torch.equal(vector, torch.stack([by_name[name] for name in batches.names]))
