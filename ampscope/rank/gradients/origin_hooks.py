"""The hooks that put an origin check inside DDP, FSDP1 and FSDP2 gradient collectives.

Each hook marks :class:`~ampscope.rank.gradients.origin.OriginFlags` with the rank's unreduced
gradients, then runs the same collective with the same pre/post division as torch's
default path, so training results are bit-identical. Use through
:func:`install_origin_hooks`, which finds the model's wrapper and returns an
:class:`OriginHandle`. The front-ends import it in ``attach()``, not at import.

This module deliberately has no ``from __future__ import annotations``: DDP compares
a comm hook's ``bucket`` and return annotations with the real classes at registration.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from ampscope.rank.compat import (
    ReduceScatter,
    ddp_comm_hooks,
    ddp_uses_python_reducer,
    fsdp1_comm_hook,
    fsdp1_hybrid,
    fsdp_default_hooks,
    fully_shard_param_groups,
    fully_shard_predivide_factor,
    param_group_data_parallel_ranks,
    param_group_reduce_scatter,
    param_group_reduce_scatter_size,
)
from ampscope.rank.gradients.origin import OriginFlags
from ampscope.reporter.schema import OriginGroup


def find_ddp(model: torch.nn.Module) -> DDP | None:
    """The DistributedDataParallel wrapper in ``model`` (``model`` itself, or inside it)."""
    found = [m for m in model.modules() if isinstance(m, DDP)]
    if len(found) > 1:
        raise ValueError(f"{type(model).__name__} holds {len(found)} DDP wrappers; attach one")
    return found[0] if found else None


def find_fsdp1_root(model: torch.nn.Module) -> FSDP | None:
    """The outermost FullyShardedDataParallel in ``model``, if it wraps all the others."""
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    if not units:
        return None
    root = units[0]  # modules() is pre-order: the first unit is an outermost one
    if len(FSDP.fsdp_modules(root)) != len(units):
        raise ValueError(
            f"{type(model).__name__} holds several FullyShardedDataParallel roots; "
            "attach the one root that wraps them all"
        )
    return root


def fsdp1_gradient_group(model: torch.nn.Module) -> tuple[bool, dist.ProcessGroup | None]:
    """Whether ``model`` holds FSDP1, and the process group over which its gradients are
    sharded (``None`` when every unit keeps whole gradients: ``NO_SHARD``)."""
    root = find_fsdp1_root(model)
    if root is None:
        return False, None
    units = FSDP.fsdp_modules(root)
    if all(unit.sharding_strategy == ShardingStrategy.NO_SHARD for unit in units):
        return True, None
    return True, root.process_group


def find_fully_shard_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every FSDP2 ``fully_shard`` module in ``model``."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _OriginState:
    """Comm hook state: where to mark, or ``flags=None`` once detached."""

    def __init__(self, flags: OriginFlags, process_group: dist.ProcessGroup) -> None:
        self.flags: OriginFlags | None = flags
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # FSDP1's own pre/post division factors for this group.
        self.fsdp_default = fsdp_default_hooks.DefaultState(process_group)

    def detach(self) -> None:
        self.flags = None


def _require_group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    # Both wrappers resolve a None group to WORLD in their constructors.
    if group is None:
        raise ValueError(f"{what} has no process group")
    return group


def _reattach(state: object, flags: OriginFlags, what: str) -> Callable[[], None]:
    """Reuse an origin hook left on the model by an earlier, removed handle."""
    assert isinstance(state, _OriginState)
    if state.flags is not None and state.flags is not flags:
        raise ValueError(
            f"origin tracking is already installed on this {what} for another scaler; "
            "call remove() on that handle (or close that scaler) first"
        )
    state.flags = flags
    return state.detach


def _hook_taken(what: str, names: str, mark: str, note: str = "") -> ValueError:
    """The error for a wrapper whose one comm hook is someone else's."""
    return ValueError(
        f"{what} already has a comm hook ({names}) and accepts only one. Either drop it, "
        f"or attach with track_origin=False and call OriginFlags.mark({mark}) inside your "
        f"own hook before its collective{note}"
    )


def _register(
    what: str,
    wrapper: DDP | FSDP,
    hook: Callable[..., object],
    flags: OriginFlags,
    refusal: type[Exception],
    advice: str = "",
) -> Callable[[], None]:
    """Register ``hook`` with a fresh state on ``wrapper``; returns the undo. ``refusal``:
    what torch raises when it refuses the hook, turned into a ValueError (``advice`` first,
    then torch's words)."""
    state = _OriginState(flags, _require_group(wrapper.process_group, what))
    try:
        wrapper.register_comm_hook(state, hook)
    except refusal as exc:
        said = f"{advice} (torch said: {exc})" if advice else str(exc)
        raise ValueError(f"{what} refused the origin comm hook: {said}") from exc
    return state.detach


def _ddp_origin_hook(
    state: _OriginState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.flags is not None:
        state.flags.mark(buffer)
    # DDP without a hook multiplies by 1/world_size while copying gradients into the
    # bucket. Multiplying here (not div_, as torch's allreduce_hook does) rounds the same
    # way for any world size; on CPU division differs in the last bit when the size is not
    # a power of 2. (DDP itself divides instead when gradient_as_bucket_view=True and the
    # grads were kept between steps; there only power-of-2 sizes match on CPU.)
    buffer.mul_(1.0 / state.world_size)
    future = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def install_ddp(ddp: DDP, flags: OriginFlags) -> Callable[[], None]:
    """Register the origin comm hook on ``ddp``; returns the undo."""
    hooks = ddp_comm_hooks(ddp)
    for hook, state in hooks:
        if hook is _ddp_origin_hook:
            return _reattach(state, flags, "DistributedDataParallel")
    if hooks:
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h, _ in hooks)
        raise _hook_taken(
            "DistributedDataParallel",
            names,
            "bucket.buffer()",
            " (DDP's mixed_precision= option registers such a hook too)",
        )
    if ddp_uses_python_reducer(ddp):
        raise ValueError(
            "DistributedDataParallel runs its Python reducer (compiled autograd), which "
            "passes single gradients, not buckets, to comm hooks; origin tracking needs "
            "the C++ reducer"
        )
    return _register(
        "DistributedDataParallel",
        ddp,
        _ddp_origin_hook,
        flags,
        RuntimeError,
        "attach the scaler before the first backward and without a builtin comm hook",
    )


def _fsdp1_origin_hook(
    state: _OriginState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    # FSDP1 calls (state, grad, output) for sharded strategies and (state, grad) for
    # NO_SHARD; torch's default hooks divide exactly like its built-in path.
    if state.flags is not None:
        state.flags.mark(grad)
    if output is None:
        fsdp_default_hooks.allreduce_hook(state.fsdp_default, grad)
    else:
        fsdp_default_hooks.reduce_scatter_hook(state.fsdp_default, grad, output)


def install_fsdp1(root: FSDP, flags: OriginFlags) -> Callable[[], None]:
    """Register the origin comm hook on the FSDP1 root and its units; returns the undo."""
    units = FSDP.fsdp_modules(root)
    if any(fsdp1_hybrid(unit) for unit in units):
        raise ValueError(
            "FullyShardedDataParallel with a hybrid sharding strategy does not support comm "
            "hooks; origin tracking needs FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (or FSDP2)"
        )
    if len({id(unit.process_group) for unit in units}) > 1:
        raise ValueError(
            "FullyShardedDataParallel units use different process groups; FSDP1 shares one "
            "comm hook state among them, so origin tracking cannot reduce correctly"
        )
    hooks = [fsdp1_comm_hook(unit) for unit in units]
    if all(hook is _fsdp1_origin_hook for hook, _ in hooks):
        return _reattach(hooks[0][1], flags, "FullyShardedDataParallel")
    others = [h for h, _ in hooks if h is not None and h is not _fsdp1_origin_hook]
    if any(hook is not None for hook, _ in hooks):
        names = ", ".join(sorted({getattr(h, "__qualname__", repr(h)) for h in others}))
        raise _hook_taken("FullyShardedDataParallel", names or "origin, partly", "grad")
    return _register("FullyShardedDataParallel", root, _fsdp1_origin_hook, flags, AssertionError)


class OriginReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter that marks the rank's unreduced input, then runs ``inner``.

    Allocation and the collective itself are delegated unchanged to the comm that
    was set before (torch's default unless the user set one), so numerics and memory
    behaviour stay as they were. FSDP2 calls it on its reduce-scatter stream after
    the pre-division, which cannot turn finite values into inf/NaN.
    """

    def __init__(self, inner: ReduceScatter, flags: OriginFlags, group: object) -> None:
        self.inner = inner
        self.flags = flags
        self.group = group
        """The FSDP2 parameter group whose gradients this comm reduces."""
        self._factors: dict[tuple[torch.dtype, str, object, object], float] = {}

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.flags.mark(input_tensor, self._predivide(input_tensor, group))
        return self.inner(output_tensor, input_tensor, group, op, async_op)

    def _predivide(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> float:
        """What FSDP2 divided ``input_tensor`` by: the norm of the rank's own gradients is
        the input's times this. Cached per dtype, device and divide settings."""
        key = (
            input_tensor.dtype,
            input_tensor.device.type,
            getattr(self.group, "gradient_divide_factor", None),
            getattr(self.group, "force_sum_reduction_for_comms", None),
        )
        factor = self._factors.get(key)
        if factor is None:
            factor = self._factors[key] = fully_shard_predivide_factor(
                self.group, group, input_tensor.dtype, input_tensor.device.type
            )
        return factor


def install_fully_shard(
    modules: list[FSDPModule], flags: OriginFlags
) -> tuple[Callable[[], None], frozenset[int]]:
    """Wrap the reduce-scatter of every FSDP2 module; returns the undo and the ranks that
    share every module's data-parallel mesh with this one (see :class:`OriginHandle`)."""
    previous: list[tuple[FSDPModule, ReduceScatter, object]] = []
    for module in modules:
        groups = fully_shard_param_groups(module)
        if not groups:
            continue  # manages no parameters: no reduce-scatter of its own
        if len(groups) > 1:
            raise ValueError(
                f"{type(module).__name__} has several FSDP2 parameter groups "
                "(shard_placement_fn with per-parameter meshes); torch allows no custom "
                "reduce-scatter there, so origin tracking cannot be installed"
            )
        if param_group_reduce_scatter_size(groups[0]) < 2:
            raise ValueError(
                f"{type(module).__name__} runs no reduce-scatter over 2 or more ranks "
                "(replicate-only or a shard mesh of size 1), so no collective sees this "
                "rank's unreduced gradients; origin tracking needs a shard group of 2+ ranks"
            )
        inner = param_group_reduce_scatter(groups[0])
        if isinstance(inner, OriginReduceScatter):
            raise ValueError(
                "origin tracking is already installed on this fully_shard model; call "
                "remove() on that handle (or close that scaler) first"
            )
        previous.append((module, inner, groups[0]))
    if not previous:
        raise ValueError("no fully_shard module of this model manages parameters")
    for module, inner, group in previous:
        module.set_custom_reduce_scatter(OriginReduceScatter(inner, flags, group))

    def undo() -> None:
        for module, inner, _ in previous:
            module.set_custom_reduce_scatter(inner)

    # The norm sums every module's gradients: ranks whose norms cover the same parameters
    # share all the meshes (experts sharded over another mesh than the dense layers).
    ranks = frozenset.intersection(*(param_group_data_parallel_ranks(g) for _, _, g in previous))
    return undo, ranks


class OriginHandle:
    """What :func:`install_origin_hooks` installed; :meth:`remove` undoes it.

    Attributes:
        kind: ``"ddp"``, ``"fsdp"`` (FSDP1 ``FullyShardedDataParallel``) or
            ``"fully_shard"`` (FSDP2).
        ranks: The global ranks whose origin norms are comparable with this rank's: those
            holding the same parameters, its data-parallel replicas (the DDP or FSDP1
            process group; the FSDP2 data-parallel mesh, HSDP's replicate x shard mesh
            whole, since the norm is of the unsharded gradient). This rank included.
    """

    def __init__(self, kind: str, undo: Callable[[], None], ranks: frozenset[int]) -> None:
        self.kind = kind
        self.ranks = ranks
        self._undo: Callable[[], None] | None = undo

    @property
    def active(self) -> bool:
        """Whether the hooks still mark flags."""
        return self._undo is not None

    def remove(self) -> None:
        """Stop origin tracking on the model. Idempotent.

        FSDP2: the previous reduce-scatter comm is put back. DDP and FSDP1 cannot
        unregister a comm hook, so the hook stays but stops checking; it keeps
        reducing exactly like torch's default, and a later :func:`install_origin_hooks`
        on the same model reuses it.
        """
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def install_origin_hooks(model: torch.nn.Module, flags: OriginFlags) -> OriginHandle:
    """Check each rank's unreduced gradients inside the model's gradient collectives.

    Call once, after wrapping the model and before training: torch documents comm
    hooks as registered before the first forward (FSDP1) or backward (DDP). Training
    results are bit-identical to training without the hooks.

    Supported models:
        * ``DistributedDataParallel`` (a DDP comm hook around its default all-reduce);
        * FSDP1 ``FullyShardedDataParallel``, the root (a comm hook around the default
          reduce-scatter, or all-reduce for ``NO_SHARD``; hybrid strategies are not
          supported by torch's comm hooks);
        * FSDP2 ``fully_shard`` modules (a custom reduce-scatter on every
          ``FSDPModule``, wrapping the one already set; HSDP is covered because its
          replica all-reduce follows the checked reduce-scatter).

    The model may also be an outer module holding one such wrapper, e.g. the result of
    ``torch.compile``. With gradient accumulation (``no_sync()`` or
    ``set_requires_gradient_sync(False)``) the collective, and so the check, runs on
    the synchronising micro-batch and sees the accumulated gradients.

    Args:
        model: The wrapped model.
        flags: Where detections accumulate.

    Returns:
        A handle whose ``remove()`` stops the tracking.

    Raises:
        TypeError: ``model`` runs no gradient collective (a plain module).
        ValueError: The model already has a user comm hook / custom reduce-scatter
            that origin tracking cannot wrap, or a configuration in which no
            collective runs on this rank's unreduced gradients.
    """
    ddp = find_ddp(model)
    fsdp1 = find_fsdp1_root(model)
    fully_shard = find_fully_shard_modules(model)
    found = [
        kind for kind, hit in (("DDP", ddp), ("FSDP", fsdp1), ("fully_shard", fully_shard)) if hit
    ]
    if len(found) > 1:
        raise ValueError(
            f"{type(model).__name__} mixes {' and '.join(found)}; origin tracking supports "
            "one data-parallel wrapper per model"
        )
    if ddp is not None:
        return OriginHandle("ddp", install_ddp(ddp, flags), _group_ranks(ddp.process_group))
    if fsdp1 is not None:
        return OriginHandle("fsdp", install_fsdp1(fsdp1, flags), _group_ranks(fsdp1.process_group))
    if fully_shard:
        return OriginHandle("fully_shard", *install_fully_shard(fully_shard, flags))
    raise TypeError(
        f"{type(model).__name__} runs no gradient collective, so there is no pre-reduction "
        "gradient to check: origin tracking needs DistributedDataParallel, "
        "FullyShardedDataParallel or fully_shard. Without data parallelism the local "
        "found-inf already is the origin; attach with track_origin=False."
    )


def _group_ranks(group: dist.ProcessGroup | None) -> frozenset[int]:
    """The global ranks of a wrapper's process group (``None``: the default group)."""
    return frozenset(dist.get_process_group_ranks(group or dist.group.WORLD))


def origin_group(handles: Sequence[OriginHandle]) -> OriginGroup | None:
    """The origin group a scaler's records name (``Setup.origin_group``): the ranks every
    active handle's model shares with this rank, so that each of them holds the same
    parameters (one scaler's origin norm sums all its attached models'). ``None`` without an
    active handle."""
    active = [handle.ranks for handle in handles if handle.active]
    if not active:
        return None
    ranks = frozenset.intersection(*active)
    if not ranks:  # models of disjoint groups: no rank holds all of this one's parameters
        return None
    return OriginGroup(first=min(ranks), size=len(ranks))
