"""A training library's own gradient clip, op for op, keeping the norms its pass computes.

torchtitan's ``clip_grad_norm_`` and OLMo-core's ``TransformerTrainModule._clip_grad_norm``
(adapted from torchtitan's) clip alike: ``torch.nn.utils.get_total_norm`` over the
gradients (DTensor gradients give a DTensor total, made whole with ``full_tensor()``: one
all-reduce over the mesh), torchtitan then sums the stages' squares over the pipeline
mesh, and ``torch.nn.utils.clip_grads_with_norm_`` clips. :func:`clip` makes the same ops
in the same order, so the total it returns and the clipped gradients are the library's
bit for bit, and also returns what the watch's own pass would compute: each parameter's
local gradient norm (a shard's, under FSDP2) and the total before the pipeline sum (this
stage's, as the records hold it).

Kept only where :func:`keeping_call` recognises the pass: the 2-norm, ``foreach`` and the
gradients such that ``get_total_norm`` makes one (device, dtype) group, every gradient
present, dense, float32 or wider (the records' norms of narrower gradients are float32,
the clip's are not), all plain tensors or all DTensors of one mesh and placements (their
stacked norms' local part is then each shard's norm). The library's function itself is
recognised by its code (:func:`recognised`); each integration holds the fingerprint of
the release it repeats, and hands anything else to the library's function unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ampscope.rank import compat
from ampscope.rank.gradients.clip import total_norm_with_norms

logger = logging.getLogger("ampscope")


class KeepingCall(NamedTuple):
    """One clip whose norms :func:`clip` keeps, and how the library's clip makes them."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    """``params``' gradients, as the clip reads them (empty where the caller reads them
    when it clips: :func:`keeping_call`'s ``read_grads``, :func:`with_grads`)."""
    max_norm: float
    norm_type: float
    error_if_nonfinite: bool
    foreach: bool | None
    foreach_path: bool
    """``get_total_norm`` takes its multi-tensor path (else one norm per tensor)."""
    pp_mesh: Any
    """torchtitan's pipeline mesh (``None`` without pipeline parallelism)."""


fingerprint = compat.source_fingerprint
"""The SHA-256 of a function's code as ``ast.unparse`` writes it without its docstring:
comments and layout do not count, any change of code does."""


def recognised(fn: Callable[..., Any], known: str, what: str) -> bool:
    """Whether ``fn`` is the code (``known``: its :func:`fingerprint`) :func:`clip`
    repeats; else (another release, no source) logs once, naming ``what``, that the watch
    norms in a pass of its own again. Reads the source: call it once per process."""
    try:
        same = fingerprint(fn) == known
    except Exception:
        logger.info("ampscope: could not read %s", what, exc_info=True)
        same = False
    if not same:
        logger.info(
            "ampscope: %s is not the code ampscope repeats; the watch norms the gradients "
            "in a pass of its own before it clips them",
            what,
        )
    return same


Layouts = dict[tuple[tuple[int, ...], bool], bool | None]
"""Per clipped parameter list (ids) and ``foreach``: the gradients' foreach path, or
``None`` where they make no keepable group. One per watch: ids are only reused once the
parameters are gone."""
_LAYOUT_KEYS = 8


def keeping_call(
    layouts: Layouts,
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    pp_mesh: Any = None,
    *,
    ids: tuple[int, ...] | None = None,
    read_grads: bool = True,
) -> KeepingCall | None:
    """The clip of ``params``' gradients with these arguments, when :func:`clip` keeps its
    norms; else ``None`` (the library's own function runs, as it does where torch's clip
    is not the pass the repeat copies, :func:`~ampscope.rank.compat.clip_unchanged`, and on
    any error of ampscope's here: logged once). Decided from the arguments and the
    gradients' layout (remembered in ``layouts``), alike on every rank of a program that
    gives every rank the same layout. Cost on a repeated parameter list: the gradients'
    list, a tuple of ids (none where the caller gives ``params``' ``ids``) and a lookup.

    ``read_grads=False``: the caller decides ahead of the clip and reads the gradients
    when it clips (:func:`with_grads`, which hands a missing one to the library). On a
    parameter list whose layout is known, nothing is then read per parameter here (the
    call's ``grads`` is empty), and the answer depends on the arguments and that layout
    only; on first sight the gradients are read to learn it."""
    try:
        return _keeping_call(
            layouts,
            params,
            max_norm,
            norm_type,
            error_if_nonfinite,
            foreach,
            pp_mesh,
            ids,
            read_grads,
        )
    except Exception:
        _warn_once()
        return None


@functools.lru_cache(maxsize=1)
def _warn_once() -> None:
    """Say once (in ``except``) that :func:`keeping_call` failed."""
    logger.warning(
        "ampscope: could not tell whether the clip keeps its norms; the library clips, "
        "the watch norms in its own pass (logged once)",
        exc_info=True,
    )


def _keeping_call(
    layouts: Layouts,
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    pp_mesh: Any,
    ids: tuple[int, ...] | None,
    read_grads: bool,
) -> KeepingCall | None:
    if not params or foreach is False or float(norm_type) != 2.0:
        return None
    if not compat.clip_unchanged():
        return None  # torch's get_total_norm is not the pass the repeat copies
    key = (ids if ids is not None else tuple(map(id, params)), foreach is None)
    path = layouts.get(key, False)
    grads: list[torch.Tensor] | None = []
    if path is False or read_grads:
        grads = present_grads(params)
        if grads is None:
            return None
    if path is False:
        if len(layouts) >= _LAYOUT_KEYS:
            layouts.clear()
        path = layouts[key] = _foreach_path(grads, foreach)  # type: ignore[arg-type]
    if path is None:
        return None
    return KeepingCall(
        params=params,
        grads=grads,  # type: ignore[arg-type]
        max_norm=max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        foreach_path=path,
        pp_mesh=pp_mesh,
    )


def present_grads(params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``params``' gradients, read now; ``None`` when one is missing (the repeat clips
    whole lists only). One read of ``.grad`` per parameter."""
    grads = [p.grad for p in params]
    for grad in grads:
        if grad is None:
            return None
    return grads  # type: ignore[return-value]


def with_grads(call: KeepingCall) -> KeepingCall | None:
    """``call`` with its parameters' gradients as they are now, right before the clip
    (callbacks may have replaced some since the decision); ``None`` when one is missing:
    the library's own clip runs then."""
    grads = present_grads(call.params)
    return None if grads is None else call._replace(grads=grads)


def _foreach_path(grads: list[torch.Tensor], foreach: bool | None) -> bool | None:
    """Which path ``get_total_norm`` takes for ``grads`` (foreach: ``True``), when they
    make one keepable group; else ``None``."""
    places = {(g.device, g.dtype) for g in grads}
    if len(places) != 1 or any(g.is_sparse for g in grads):
        return None
    device, dtype = next(iter(places))
    if not dtype.is_floating_point or dtype.itemsize < 4:
        return None
    layouts = {
        (id(g.device_mesh), tuple(g.placements)) if compat.is_dtensor(g) else None  # type: ignore[attr-defined]
        for g in grads
    }
    if len(layouts) != 1:
        return None
    if foreach is None:
        # torch's own choice (its foreach types: plain tensors and DTensors alike).
        return compat.foreach_supported(grads, device)
    # foreach=True where the device has no foreach kernels: torch raises; the library's.
    return True if compat.device_foreach_supported(device) else None


@torch.no_grad()
def clip(call: KeepingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's clip of ``call``'s gradients, keeping its norms.

    Cost: the library's (the norms, a stack, their norm, a DTensor total's all-reduce,
    with pipeline parallelism the stages' all-reduce, the clip's multiply); with pipeline
    parallelism also one copy of the one-element stage total.

    Returns:
        The total norm the library returns (over the whole model), the per-parameter norms
        of the local gradients stacked in the order of ``call.params``, and this stage's
        total norm (the first value without pipeline parallelism).
    """
    norm_type = call.norm_type
    total, norms = total_norm_with_norms(
        call.grads, norm_type, call.error_if_nonfinite, foreach=call.foreach_path
    )
    local = compat.local_tensor(norms)
    if compat.is_dtensor(total):
        total = total.full_tensor()  # type: ignore[attr-defined]
    stage = total
    if call.pp_mesh is not None:
        stage = total.clone()  # torchtitan's pipeline sum is in place
        total **= norm_type
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=call.pp_mesh.get_group())
        total **= 1.0 / norm_type
    torch.nn.utils.clip_grads_with_norm_(call.params, call.max_norm, total, call.foreach)
    return total, local, stage
