"""A plan's per-parameter gradient norms on the CPU in a few tensor ops, whatever the number
of parameters (:class:`NormBatches`): what :class:`~ampscope.rank.gradients.stats.GradStats`
norms with on the CPU, where torch's multi-tensor norm is a loop of one norm per tensor.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ampscope.rank import compat


class NormBatches:
    """A simple plan's per-parameter norms in a few tensor ops on the CPU, whatever the
    number of parameters.

    On the CPU torch's multi-tensor norm is a loop of one norm per tensor (some 10,000
    instructions of dispatch each, whatever the tensor's size), and the telemetry thread
    would then stack the results. Small gradients of one shape (each transformer block's
    biases, norms and same-shaped weights) are stacked into one matrix and normed along its
    rows in one reduction; the rest (large gradients, where the dispatch is nothing against
    the elements) go through the multi-tensor norm. The result is one vector, in the order
    of :attr:`names`, with the per-tensor norms' values to float32 rounding (a row's
    reduction may add in another order than the tensor's own: an ulp at most).
    """

    __slots__ = ("gathers", "names", "order", "rest", "sizes")

    def __init__(self, plan_names: tuple[str, ...], params: tuple[torch.Tensor, ...]) -> None:
        by_shape: dict[tuple[Any, ...], list[int]] = {}
        for index, param in enumerate(params):
            if param.numel() <= STACK_NUMEL:
                by_shape.setdefault((tuple(param.shape), param.dtype), []).append(index)
        stacked = [ix for ix in by_shape.values() if len(ix) > 1]
        placed = {i for ix in stacked for i in ix}
        rest = [i for i in range(len(params)) if i not in placed]
        self.gathers = tuple(operator.itemgetter(*ix) for ix in stacked)
        """Per stack: picks its gradients out of the list of all of them."""
        self.sizes = tuple(len(ix) for ix in stacked)
        self.rest = operator.itemgetter(*rest) if rest else None
        """The gradients normed one by one (large, or alone of their shape)."""
        self.order = tuple(i for ix in stacked for i in ix) + tuple(rest)
        """The gradients' indices in the order of the vector of norms."""
        self.names = tuple(plan_names[i] for i in self.order)
        """The parameters' names in the order of the vector of norms."""

    def norms(self, grads: list[torch.Tensor], low_precision: bool) -> torch.Tensor:
        """The vector of the gradients' L2 norms (float32 where ``low_precision``), in the
        order of :attr:`names`. One stack and one norm per shape, one multi-tensor norm
        for the rest, one concatenation."""
        dtype = torch.float32 if low_precision else None
        try:
            parts = [
                # reshape, not flatten(1): 0-dim parameters (learned scales) stack to (n,).
                torch.linalg.vector_norm(
                    torch.stack(gather(grads)).reshape(size, -1), dim=1, dtype=dtype
                )
                for gather, size in zip(self.gathers, self.sizes, strict=True)
            ]
        except RuntimeError:
            # A gradient no longer has its parameter's shape at planning (a parameter's
            # data replaced): one by one, as the accelerators' path.
            ordered = [grads[i] for i in self.order]
            return torch.stack(compat.foreach_norm(ordered, low_precision))
        if self.rest is not None:
            picked = self.rest(grads)
            rest = [picked] if isinstance(picked, torch.Tensor) else list(picked)
            parts.append(torch.stack(compat.foreach_norm(rest, low_precision)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


STACK_NUMEL = 1 << 13
"""Gradients up to this many elements are stacked with others of their shape for the CPU's
norms: copying them costs less than a norm's dispatch; larger ones are normed in place
(measured on one thread: the copy wins up to 4,096 elements, loses from 16,384)."""
