"""Gradient clipping that keeps what its one pass over the gradients computed.

``torch.nn.utils.clip_grad_norm_`` reads every gradient once for the per-tensor norms,
stacks them into one vector and takes that vector's norm: the total norm it returns and
clips with. :func:`clip_grad_norm_with_norms` does the same, with the same torch ops in the
same order (so the total norm and the clipped gradients are bit for bit torch's), and also
returns the stacked per-tensor norms: the gradient norms a front-end records need no
second pass over gradient memory when the loop clips through it.

Only the case torch's foreach path handles in one group is kept: the 2-norm of dense
gradients that share one device and dtype, none missing. Anything else is handed to
torch's own function unchanged, and returns no norms.
"""

from __future__ import annotations

import torch

from ampscope.rank import compat


def clippable(params: list[torch.Tensor], norm_type: float, foreach: bool | None) -> bool:
    """Whether :func:`clip_grad_norm_with_norms` keeps the norms of ``params``' gradients:
    the 2-norm of dense plain gradients on one device and dtype with foreach kernels, none
    missing (torch's one-group foreach path). The checks torch's clipping makes itself."""
    if float(norm_type) != 2.0 or foreach is False or not params:
        return False
    grads = [p.grad for p in params]
    if any(g is None or g.is_sparse for g in grads):
        return False
    places = {(g.device, g.dtype) for g in grads}  # type: ignore[union-attr]
    if len(places) != 1:
        return False
    device = next(iter(places))[0]
    return compat.foreach_supported(grads, device)  # type: ignore[arg-type]


def clip_grad_norm_with_norms(
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch.nn.utils.clip_grad_norm_(params, ...)``, keeping its per-tensor norms when
    ``keep`` (only where :func:`clippable` said so).

    Cost: torch's (one multi-tensor norm, a stack, a norm, the clip's multi-tensor
    multiply); ``error_if_nonfinite`` reads the total norm on the host, as torch does.

    Returns:
        The total norm (what torch returns) and, when ``keep``, the per-parameter norms
        stacked in the order of ``params`` (a 1-D tensor in the gradients' dtype, on their
        device); else ``None``.
    """
    if not keep:
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )
        return total, None
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    total, norms = total_norm_with_norms(grads, norm_type, error_if_nonfinite)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total, norms


def total_norm_with_norms(
    grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool, *, foreach: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, ...)`` where
    the gradients make one (device, dtype) group (the caller checks), keeping the stacked
    per-tensor norms: ``foreach`` where torch takes its multi-tensor path (with
    ``foreach=None``, for plain tensors and DTensors alike, torch counting DTensor among
    its foreach types), else its per-tensor one. DTensor
    gradients give DTensors, as torch's: the norms partial over the ranks holding the
    shards (their local part is each local shard's norm), the total summed over them by
    DTensor (one all-reduce).

    Returns:
        The total norm, bit for bit torch's, and the per-tensor norms, stacked in order.
    """
    norm_type = float(norm_type)
    # torch's _get_total_norm for one group: the norms, stacked, their norm.
    if foreach:
        each = compat.foreach_norm_typed(grads, norm_type)
    else:
        each = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    norms = torch.stack(each)
    total = torch.linalg.vector_norm(norms, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total, norms
