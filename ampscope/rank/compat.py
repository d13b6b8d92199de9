"""Every touch of torch's private scaler, DTensor, FSDP and DDP state, in one place.

The instrumented scalers subclass torch's and must read a few things torch does not
expose publicly: the per-optimizer found-inf tensors, the scale and growth-tracker
tensors and their per-optimizer stage, the ``_unscale_grads_`` hook point and the rule
of ``_maybe_opt_step`` (it calls ``optimizer.step()`` only when found-inf is zero, which
tells the scaler a step was clean without a second read), DTensor local shards
and the found-inf reduction rule of DTensor's dispatch, FSDP1 FlatParameter shard
metadata, and, for origin tracking, the comm hooks DDP and FSDP1 hold, FSDP1's default
comm hooks and FSDP2's reduce-scatter comm objects. Nothing else in ampscope reads
private torch attributes.

:func:`check_torch` verifies each assumption and names what changed;
``tests/rank/test_compat.py`` fails loudly on any problem, and the scalers log a
warning once per process when running on a torch that breaks one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import logging
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.distributed.algorithms._comm_hooks import default_hooks as fsdp_default_hooks
from torch.distributed.fsdp import FSDPModule, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.nn.parallel import DistributedDataParallel as DDP

logger = logging.getLogger("ampscope")

__all__ = [
    "FlatSegment",
    "OptState",
    "ReduceScatter",
    "check_torch",
    "clean_param_name",
    "ddp_comm_hooks",
    "ddp_uses_python_reducer",
    "dtensor_replica_group",
    "flat_param_segments",
    "float8_amax_to_scale",
    "float8_casts",
    "float8_layer_input",
    "float8_linear_type",
    "float8_precast",
    "float8_sharded_weights",
    "foreach_norm",
    "forget_unscale",
    "found_inf_reduction",
    "fsdp1_comm_hook",
    "fsdp1_hybrid",
    "fsdp1_replica_group",
    "fsdp_default_hooks",
    "fully_shard_param_groups",
    "fully_shard_predivide_factor",
    "is_dtensor",
    "local_tensor",
    "non_finite_check_",
    "non_finite_check_by_norm_",
    "param_group_reduce_scatter",
    "param_group_reduce_scatter_size",
    "reduce_found_inf",
    "reduce_square_sum",
    "scale_and_tracker",
    "scale_tensor",
    "scaler_device",
    "square_sum_reduction",
    "steps_itself",
    "tensor_version",
    "unscaled_found_inf",
    "update_inputs",
]

# Prefixes module wrappers insert into parameter names (FSDP1, activation checkpointing,
# torch.compile). FSDP1 spells them in torch.distributed.fsdp._common_utils.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_FLAT_PARAM_NAME = "_flat_param"


# -- GradScaler internals ---------------------------------------------------------------


def scale_tensor(scaler: _TorchGradScaler) -> torch.Tensor | None:
    """The scale tensor (``None`` until the first ``scale()``)."""
    scale: torch.Tensor | None = scaler._scale
    return scale


def scaler_device(scaler: _TorchGradScaler) -> str:
    """The device string the scaler was built for (``"cuda"``, ``"cpu"``...)."""
    return str(scaler._device)


def scale_and_tracker(
    scaler: _TorchGradScaler,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The scale and growth-tracker tensors (``None`` until the first ``scale()``).
    ShardedGradScaler on CPU replaces the tracker on each update()."""
    return scaler._scale, scaler._growth_tracker


def steps_itself(optimizer: object) -> bool:
    """Whether torch's step() hands ``optimizer`` the scale and found-inf and lets it skip
    itself (fused/capturable optimizers) instead of calling ``_maybe_opt_step``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def update_inputs(
    scaler: _TorchGradScaler,
) -> tuple[torch.Tensor | None, list[tuple[int, bool, Mapping[torch.device, torch.Tensor]]]]:
    """What update() consumes: the scale, and for every optimizer of this iteration, in the
    order update() reads them, ``(id(optimizer), whether step() ran for it, found-inf per
    device)``. Read found-inf values before update(): it adds the tensors into the first
    one in place."""
    stepped = OptState.STEPPED
    return scaler._scale, [
        (key, state["stage"] is stepped, state["found_inf_per_device"])
        for key, state in scaler._per_optimizer_states.items()
    ]


def unscaled_found_inf(
    scaler: _TorchGradScaler, optimizer: object
) -> Mapping[torch.device, torch.Tensor] | None:
    """``optimizer``'s found-inf per device once this iteration unscaled it, else ``None``."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.UNSCALED:
        return None
    found: Mapping[torch.device, torch.Tensor] = state["found_inf_per_device"]
    return found


def forget_unscale(scaler: _TorchGradScaler, optimizer: object) -> None:
    """Reset ``optimizer``'s per-iteration state to torch's fresh one, so that the next
    ``unscale_`` (after a rerun recomputed the gradients) unscales them and recomputes
    found-inf from them instead of raising that it already ran."""
    scaler._per_optimizer_states[id(optimizer)] = _refresh_per_optimizer_state()


def unscale_one_group_(
    grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """``GradScaler._unscale_grads_`` where every gradient is present, dense and of one
    device and dtype (the caller checks, and torch's ``allow_fp16``): the same kernel on
    the same gradients, with ``found_inf`` and ``inv_scale`` copied to their device as
    torch's ``_MultiDeviceReplicator`` copies them, so the gradients, the flag and the
    returned dict are torch's, bit for bit. Without torch's walk over the parameters in
    Python (some 500 ns a parameter), which the caller's own list of gradients replaces.
    Only where :func:`unscale_unchanged` and :func:`torch_unscale_unpatched`."""
    device = grads[0].device
    found = found_inf.to(device=device, non_blocking=True, copy=True)
    inv = inv_scale.to(device=device, non_blocking=True, copy=True)
    with torch.no_grad():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    return {device: found}


def source_fingerprint(fn: Callable[..., Any]) -> str:
    """The SHA-256 of ``fn``'s code as ``ast.unparse`` writes it without its docstring:
    comments and layout do not count, any change of code does."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TypeError(f"{fn!r} is not a function")
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        node.body = node.body[1:]
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()


TORCH_UNSCALE: Callable[..., Any] = _TorchGradScaler.__dict__["_unscale_grads_"]
"""torch's ``GradScaler._unscale_grads_`` as it was when ampscope was imported: a patch of it
made later (:func:`unscale_one_group_` would bypass it) turns the shortcut off."""

_KNOWN_UNSCALE = {
    # torch 2.13: GradScaler._unscale_grads_, _MultiDeviceReplicator.get
    (
        "ee9df4ba45ad86d90c50bc701ada2722b95fa4846f2a73249936d5f14d8f7eca",
        "025a20fd07d327c5801fec35bab2c56a4950dff473f71f84ca97d4e34385fa20",
    ),
}
"""The :func:`source_fingerprint` pairs of the torch code :func:`unscale_one_group_` does for
one group. Another release's code runs as torch's own until its pair is added here."""


@functools.lru_cache(maxsize=1)
def unscale_unchanged() -> bool:
    """Whether torch's ``GradScaler._unscale_grads_`` (as imported: :data:`TORCH_UNSCALE`)
    and its replicator are code :func:`unscale_one_group_` is known to do for one group.
    Reads torch's source once per process."""
    from torch.amp.grad_scaler import _MultiDeviceReplicator

    try:
        pair = (
            source_fingerprint(TORCH_UNSCALE),
            source_fingerprint(_MultiDeviceReplicator.__dict__["get"]),
        )
    except Exception:
        return False
    return pair in _KNOWN_UNSCALE


def torch_unscale_unpatched() -> bool:
    """Whether ``GradScaler._unscale_grads_`` is still :data:`TORCH_UNSCALE` (one lookup)."""
    return _TorchGradScaler.__dict__.get("_unscale_grads_") is TORCH_UNSCALE


_KERNEL_LACKS: set[tuple[str, torch.dtype]] = set()
"""(device type, dtype) groups torch's found-inf kernel refused: its CUDA kernel has no
bfloat16 (torch 2.11 on an H200), while its CPU kernel has."""


def non_finite_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """torch's fused multi-tensor found-inf kernel, as its unscale runs it on one (device,
    dtype) group: sets ``found_inf`` (a one-element float32 tensor on their device) to 1
    when any element is inf/NaN and multiplies every element by ``inv_scale``. With an
    ``inv_scale`` of 1 the kernel writes each value back unchanged (torch skips the
    multiplication), except that a NaN may come back as a NaN of another bit pattern when
    the gradient dtype is narrower than float32. One read of the group's memory, no sync.

    Where torch's kernel lacks the group's dtype (bfloat16 on CUDA) it falls back to
    :func:`non_finite_check_by_norm_`, which only reads: every caller in ampscope passes an
    ``inv_scale`` of 1 (a check, never an unscale)."""
    key = (grads[0].device.type, grads[0].dtype) if grads else None
    if key not in _KERNEL_LACKS:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            return
        except (NotImplementedError, RuntimeError) as exc:
            if key is None or "not implemented" not in str(exc).lower():
                raise
            _KERNEL_LACKS.add(key)
    # ampscope only checks with it (an inv_scale of 1, never an unscale): reading suffices.
    non_finite_check_by_norm_(grads, found_inf)


def non_finite_check_by_norm_(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Sets ``found_inf`` to 1 when any element of ``grads`` (one device and dtype) is
    inf/NaN, from their L1 norms accumulated in float64 (a sum carries inf and NaN; finite
    bf16 or fp16 values cannot overflow it, a float32 sum could). Reads the gradients, never
    writes them: one multi-tensor norm, a stack and two small ops, no sync."""
    norms = torch._foreach_norm(grads, 1, dtype=torch.float64)
    bad = torch.stack(norms).isfinite().logical_not().any()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))


def non_finite_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A bool vector on the tensors' device (one device; dtypes may mix): whether each
    tensor holds inf/NaN, from its L1 norm accumulated in float64, as
    :func:`non_finite_check_by_norm_` reads them (exact: a sum carries inf and NaN on every
    device, and no finite float32 tensor overflows a float64 sum). Reads only: one
    multi-tensor norm, a stack and one small op, no sync."""
    norms = torch._foreach_norm(tensors, 1, dtype=torch.float64)
    return torch.stack(norms).isfinite().logical_not_()


def foreach_norm(tensors: list[torch.Tensor], low_precision: bool) -> tuple[torch.Tensor, ...]:
    """The L2 norm of each tensor: torch's multi-tensor norm, the one ``clip_grad_norm_``
    runs (one read of the tensors' memory, one kernel per device and dtype group on
    accelerators). ``low_precision``: some tensors are narrower than float32, and their
    norms are computed and returned in float32 (a float16 norm overflows at 65504); else
    the norms keep the tensors' dtype (float32 or wider), which spares the argument's cost."""
    if low_precision:
        return torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch._foreach_norm(tensors, 2)


def foreach_norm_typed(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each tensor, exactly as ``clip_grad_norm_``'s foreach path
    computes them (no dtype argument: each norm in its tensor's dtype)."""
    return list(torch._foreach_norm(tensors, norm_type))


def foreach_supported(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether torch's clipping would take its foreach path for ``tensors`` on ``device``
    (``foreach=None``): plain tensors on a device with foreach kernels."""
    from torch.utils._foreach_utils import _has_foreach_support

    return bool(_has_foreach_support(tensors, device))


def device_foreach_supported(device: torch.device) -> bool:
    """Whether torch's clipping takes its foreach path on ``device`` with ``foreach=True``
    (it raises where not): the device has foreach kernels, whatever the tensors' type
    (DTensors included)."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(_device_has_foreach_support(device))


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter: autograd's count of in-place changes to its data."""
    version: int = tensor._version
    return version


# -- DTensor ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2 ``fully_shard`` or tensor-parallel grads,
    and their parameters); plain tensors and parameters answer without a lookup."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        return False
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor, the tensor itself otherwise. No copy."""
    if is_dtensor(tensor):
        local: torch.Tensor = tensor._local_tensor  # type: ignore[attr-defined]
        return local
    return tensor


def dtensor_replica_group(param: torch.Tensor) -> Any:
    """The group of the ranks holding the same local values of DTensor ``param``: its
    mesh's first dimension with a ``Replicate`` placement (FSDP2 HSDP's replicate
    dimension); ``None`` for a plain tensor or one sharded on every dimension."""
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor import Replicate

    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if isinstance(placement, Replicate):
            return param.device_mesh.get_group(dim)  # type: ignore[attr-defined]
    return None


def sparse_values(tensor: torch.Tensor, *, coalesce: bool = False) -> torch.Tensor:
    """The values a sparse COO tensor stores (``_values()``), duplicates summed first when
    ``coalesce`` (as a norm needs; a non-finite check does not). No copy unless coalescing."""
    return (tensor.coalesce() if coalesce else tensor)._values()


@dataclass(frozen=True)
class FoundInfReduction:
    """How DTensor's dispatch reduces found-inf for a group of grads: over ``mesh``, with
    ``Partial("max")`` on every mesh dimension the grad is not replicated on."""

    mesh: Any
    placements: tuple[Any, ...]


def found_inf_reduction(grad: torch.Tensor) -> FoundInfReduction:
    """The reduction torch's ``found_inf_reduce_handler`` applies for a group whose first
    grad is ``grad`` (torch/distributed/tensor/_dispatch.py)."""
    from torch.distributed.tensor import Partial, Replicate

    placements = tuple(
        p if isinstance(p, Replicate) else Partial("max")
        for p in grad.placements  # type: ignore[attr-defined]
    )
    return FoundInfReduction(mesh=grad.device_mesh, placements=placements)  # type: ignore[attr-defined]


def reduce_found_inf(found_inf: torch.Tensor, reduction: FoundInfReduction) -> None:
    """Max-reduce ``found_inf`` in place exactly as DTensor's dispatch does (a collective)."""
    from torch.distributed.tensor import DTensor

    reduced = DTensor.from_local(
        found_inf, reduction.mesh, reduction.placements, run_check=False
    ).full_tensor()
    found_inf.copy_(reduced)


def square_sum_reduction(param: torch.Tensor) -> FoundInfReduction | None:
    """How to sum a squared norm of ``param``'s local gradient shard over the ranks holding
    the other shards: over its mesh, ``Partial("sum")`` on every sharded mesh dimension
    (replicated ones hold the same values and are not summed). ``None`` when ``param`` is
    no DTensor or is replicated everywhere."""
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor import Partial, Replicate

    placements = tuple(
        p if isinstance(p, Replicate) else Partial("sum")
        for p in param.placements  # type: ignore[attr-defined]
    )
    if all(isinstance(p, Replicate) for p in placements):
        return None
    return FoundInfReduction(mesh=param.device_mesh, placements=placements)  # type: ignore[attr-defined]


def reduce_square_sum(square_sum: torch.Tensor, reduction: FoundInfReduction) -> torch.Tensor:
    """``square_sum`` (a 0-dim local sum of squares) summed over ``reduction``'s sharded mesh
    dimensions: one all-reduce, as ``clip_grad_norm_`` does for DTensor gradients."""
    from torch.distributed.tensor import DTensor

    reduced: torch.Tensor = DTensor.from_local(
        square_sum.reshape(1), reduction.mesh, reduction.placements, run_check=False
    ).full_tensor()
    return reduced.reshape(())


# -- FSDP1 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatSegment:
    """An original parameter's slice of this rank's FlatParameter shard."""

    relative_name: str
    """Name relative to the module whose FSDP handle owns the FlatParameter."""
    offset: int
    numel: int


def flat_param_segments(param: torch.Tensor) -> list[FlatSegment] | None:
    """The original parameters inside this rank's shard of an FSDP1 FlatParameter
    (``use_orig_params=False``), or ``None`` if ``param`` is not one."""
    infos = getattr(param, "_shard_param_infos", None)
    fqns = getattr(param, "_fqns", None)
    if infos is None or fqns is None:
        return None
    return [
        FlatSegment(
            relative_name=fqn, offset=int(info.offset_in_shard), numel=int(info.numel_in_shard)
        )
        for fqn, info in zip(fqns, infos, strict=True)
        if info.in_shard
    ]


def clean_param_name(name: str) -> tuple[str, bool]:
    """A parameter name without wrapper prefixes, and whether it named a FlatParameter.

    For a FlatParameter the result is the prefix of the owning module (``""`` at the root,
    else ending in ``.``) to which its segments' relative names are appended.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name == _FLAT_PARAM_NAME or name.endswith("." + _FLAT_PARAM_NAME):
        return name[: -len(_FLAT_PARAM_NAME)], True
    return name, False


# -- gradient collectives (origin tracking) ----------------------------------------------
# FSDP1's default comm hooks (``fsdp_default_hooks``), FSDP2's ``ReduceScatter`` comm base
# class and ``FSDPMeshInfo`` are private imports above; these read state with no accessor.


def ddp_comm_hooks(ddp: DDP) -> list[tuple[Callable[..., object], object]]:
    """(hook, state) pairs registered through ``DDP.register_comm_hook``."""
    return list(ddp._comm_hooks)


def ddp_uses_python_reducer(ddp: DDP) -> bool:
    """DDP's compiled-autograd mode calls comm hooks with (grad, param), not buckets."""
    return bool(ddp._use_python_reducer)


def fsdp1_hybrid(unit: FSDP) -> bool:
    """Whether an FSDP1 unit shards hybridly: ``HYBRID_SHARD`` or the private
    ``_HYBRID_SHARD_ZERO2`` (torch's comm hooks support neither)."""
    return unit.sharding_strategy in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2,
    )


def fsdp1_replica_group(root: FSDP) -> Any:
    """The group of the ranks holding the same FlatParameter shards as this one under
    FSDP1: the inter-node group (``_inter_node_pg``, no accessor) of a hybrid root, the
    process group of a ``NO_SHARD`` root, ``None`` for the others (no replica)."""
    if fsdp1_hybrid(root):
        return getattr(root, "_inter_node_pg", None)
    if root.sharding_strategy == ShardingStrategy.NO_SHARD:
        return root.process_group
    return None


def fsdp1_comm_hook(unit: FSDP) -> tuple[object, object]:
    """(hook, state) FSDP1 calls for this unit's gradient reduction; (None, None) is the
    default."""
    return unit._comm_hook, unit._comm_hook_state


def fully_shard_param_groups(module: FSDPModule) -> list[object]:
    """The FSDP2 parameter groups of one ``fully_shard`` module.

    Newer torch keeps a list (``_fsdp_param_groups``); torch 2.11 and earlier keep at
    most one group (``_fsdp_param_group``, ``None`` without parameters).
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def param_group_reduce_scatter(group: object) -> ReduceScatter:
    """The reduce-scatter comm an FSDP2 parameter group uses (default or custom)."""
    comm: ReduceScatter = group._reduce_scatter_comm  # type: ignore[attr-defined]
    return comm


def param_group_reduce_scatter_size(group: object) -> int:
    """Ranks in the group's reduce-scatter; FSDP2 skips the collective below 2."""
    mesh_info = group.mesh_info  # type: ignore[attr-defined]
    if not isinstance(mesh_info, FSDPMeshInfo):  # replicate(): all-reduce only
        return 0
    return int(mesh_info.shard_mesh_size)


def param_group_data_parallel_ranks(group: object) -> frozenset[int]:
    """The global ranks of an FSDP2 parameter group's data-parallel mesh (``mesh_info.mesh``,
    no accessor): its shard dimension, or HSDP's replicate x shard mesh whole; never the
    tensor-parallel dimensions (torch extracts the data-parallel submesh)."""
    mesh = group.mesh_info.mesh  # type: ignore[attr-defined]
    return frozenset(int(rank) for rank in mesh.mesh.flatten().tolist())


def fully_shard_predivide_factor(
    group: object, reduce_scatter_group: Any, dtype: torch.dtype, device_type: str
) -> float:
    """What FSDP2 divided a reduce-scatter input by before handing it to the comm: its
    pre-divide factor for this parameter group, gradient dtype and device (1.0 when it
    lets the collective average instead)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    mesh_info = group.mesh_info  # type: ignore[attr-defined]
    all_reduce_group = (
        mesh_info.replicate_process_group if isinstance(mesh_info, DDPMeshInfo) else None
    )
    pre, _, _, _ = _get_gradient_divide_factors(
        reduce_scatter_group,
        all_reduce_group,
        dtype,
        device_type,
        group.gradient_divide_factor,  # type: ignore[attr-defined]
        group.force_sum_reduction_for_comms,  # type: ignore[attr-defined]
    )
    return float(pre) if pre else 1.0


# -- self-check -------------------------------------------------------------------------


# -- torchao float8 training (read only where torchao is already imported) ----------------

_FLOAT8_LINEAR_MODULE = "torchao.float8.float8_linear"


def float8_linear_type() -> type | None:
    """torchao's ``Float8Linear`` class, or ``None`` when torchao's float8 training is not
    imported: a model can hold no ``Float8Linear`` then, and nothing is imported here."""
    module = sys.modules.get(_FLOAT8_LINEAR_MODULE)
    found = getattr(module, "Float8Linear", None) if module is not None else None
    return found if isinstance(found, type) else None


@dataclass(frozen=True)
class Float8Cast:
    """How a ``Float8Linear`` casts one of its tensors for the GEMM ampscope describes:
    ``input`` and ``weight`` for the GEMM computing ``output``, ``grad_output`` for the one
    computing ``grad_input`` (torchao's ``cast_config_input``, ``cast_config_weight``,
    ``cast_config_grad_output``)."""

    tensor: str
    """``input``, ``weight`` or ``grad_output``."""
    dtype: torch.dtype
    rowwise: bool
    """torchao's ``AXISWISE`` granularity: one scale per row."""
    row_dim: int
    """The dim a rowwise amax reduces, on the tensor as ampscope reads it (the module's
    ``weight``, not its transpose; the 2-D ``grad_output``)."""
    power_of_2: bool
    """``round_scales_to_power_of_2``: scales rounded down to a power of two."""


def float8_casts(module: torch.nn.Module) -> list[Float8Cast]:
    """The dynamic casts of a ``Float8Linear``, in the order input, weight, grad_output;
    a tensor left in high precision (``ScalingType.DISABLED``) is left out."""
    config: Any = module.config
    out = []
    for tensor, cast_config, row_dim in (
        ("input", config.cast_config_input, -1),
        # torchao casts weight.t() along its dim 0: each row of the module's weight.
        ("weight", config.cast_config_weight, 1),
        ("grad_output", config.cast_config_grad_output, -1),
    ):
        if cast_config.scaling_type.value != "dynamic":
            continue
        out.append(
            Float8Cast(
                tensor=tensor,
                dtype=cast_config.target_dtype,
                rowwise=cast_config.scaling_granularity.value == "axiswise",
                row_dim=row_dim,
                power_of_2=bool(config.round_scales_to_power_of_2),
            )
        )
    return out


def float8_amax_to_scale(amax: torch.Tensor, cast: Float8Cast) -> torch.Tensor:
    """The scale torchao derives from ``amax`` for ``cast`` (its own ``amax_to_scale``)."""
    from torchao.float8.float8_utils import amax_to_scale

    scale: torch.Tensor = amax_to_scale(amax, cast.dtype, cast.power_of_2)
    return scale


def float8_layer_input(tensor: torch.Tensor) -> torch.Tensor:
    """The input as ``Float8Linear.forward`` hands it to its cast: under CUDA autocast it
    first casts it to the autocast dtype (torchao asks the GPU's autocast only)."""
    if torch.is_autocast_enabled():
        return tensor.to(torch.get_autocast_gpu_dtype())
    return tensor


def float8_precast(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(fp8 data, scale)`` of a weight that reaches the layer already cast (FSDP2's
    float8 all-gather), else ``None``."""
    module = sys.modules.get("torchao.float8.float8_training_tensor")
    cls = getattr(module, "Float8TrainingTensor", None) if module is not None else None
    if cls is None:
        return None
    inner: Any = local_tensor(tensor) if is_dtensor(tensor) else tensor
    if not isinstance(inner, cls):
        return None
    return inner._data, inner._scale


def float8_sharded_weights(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """This rank's high-precision shard of each weight that FSDP2 all-gathers in float8
    (``enable_fsdp_float8_all_gather``), by ``id()`` of its module."""
    module = sys.modules.get("torchao.float8.fsdp_utils")
    cls = getattr(module, "WeightWithDynamicFloat8CastTensor", None) if module else None
    if cls is None:
        return {}
    out: dict[int, torch.Tensor] = {}
    for fsdp_module in model.modules():
        if not isinstance(fsdp_module, FSDPModule):
            continue
        for group in fully_shard_param_groups(fsdp_module):
            for fsdp_param in group.fsdp_params:  # type: ignore[attr-defined]
                info = fsdp_param._module_info
                if info.param_name != "weight":
                    continue
                shard: Any = local_tensor(fsdp_param.sharded_param)
                if isinstance(shard, cls):
                    out[id(info.module)] = shard._tensor
    return out


def _signature_names(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check_clip() -> list[str]:
    """``clip_grad_norm_`` still stacks its foreach norms and takes their norm, the pass
    :mod:`ampscope.rank.gradients.clip` repeats bit for bit."""
    from torch.nn.utils import clip_grad

    total = inspect.getsource(clip_grad._get_total_norm)
    clip = inspect.getsource(clip_grad._clip_grads_with_norm_)
    if (
        "torch._foreach_norm(device_tensors, norm_type)" not in total
        or "torch.linalg.vector_norm(" not in total
        or "torch.stack([norm.to(first_device) for norm in norms])" not in total
        or "_foreach_mul_" not in clip
    ):
        return [
            "torch.nn.utils.clip_grad_norm_ no longer takes the norm of its stacked foreach "
            "norms; ampscope's clip_grad_norm_ must be revisited"
        ]
    return []


@functools.lru_cache(maxsize=1)
def clip_unchanged() -> bool:
    """Whether torch's clip is still the pass ampscope repeats (:func:`check_torch`'s
    clip check finds nothing). Reads torch's source once per process."""
    try:
        return not _check_clip()
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def check_torch() -> tuple[str, ...]:
    """Every assumption above that this torch breaks, each naming what changed. Cheap;
    cached per process."""
    problems: list[str] = []
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    expected = {
        "_unscale_grads_": ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"],
        "_maybe_opt_step": ["self", "optimizer", "optimizer_state", "args", "kwargs"],
        "_check_inf_per_device": ["self", "optimizer"],
    }
    source = inspect.getsource(_TorchGradScaler._maybe_opt_step)
    if ".item()" not in source or "optimizer.step(" not in source:
        problems.append(
            "GradScaler._maybe_opt_step no longer reads found-inf on the host before calling "
            "optimizer.step(); ampscope's clean-step detection must be revisited"
        )
    for cls in (_TorchGradScaler, ShardedGradScaler):
        for method, params in expected.items():
            fn = getattr(cls, method, None)
            if fn is None:
                problems.append(f"{cls.__qualname__}.{method} no longer exists")
            elif _signature_names(fn) != params:
                problems.append(
                    f"{cls.__qualname__}.{method} signature changed: "
                    f"{_signature_names(fn)} != {params}"
                )
    problems.extend(_check_non_finite_kernel())
    problems.extend(_check_clip())
    probe = _TorchGradScaler("cpu", init_scale=2.0)
    probe.scale(torch.ones(()))
    for attr in ("_device", "_scale", "_growth_tracker", "_per_optimizer_states"):
        if not hasattr(probe, attr):
            problems.append(f"GradScaler no longer has attribute {attr}")
    states = getattr(probe, "_per_optimizer_states", {})
    fresh = states[0] if hasattr(states, "default_factory") else {}
    if set(fresh) != {"stage", "found_inf_per_device"}:
        problems.append(f"GradScaler per-optimizer state keys changed: {sorted(fresh)}")
    if set(_refresh_per_optimizer_state()) != {"stage", "found_inf_per_device"}:
        problems.append("torch.amp.grad_scaler._refresh_per_optimizer_state changed")
    if {s.name for s in OptState} != {"READY", "UNSCALED", "STEPPED"}:
        problems.append("torch.amp.grad_scaler.OptState members changed")
    problems.extend(_check_dtensor())
    problems.extend(_check_flat_param())
    problems.extend(_check_hybrid_group())
    problems.extend(_check_collectives())
    problems.extend(_check_stats())
    return tuple(problems)


def _check_stats() -> list[str]:
    """The multi-tensor norm must take a dtype, and FSDP2 must still say its pre-divide
    factor the way :func:`fully_shard_predivide_factor` reads it."""
    problems = []
    try:
        norms = foreach_norm([torch.tensor([3.0, 4.0], dtype=torch.float16)], True)
        if norms[0].dtype != torch.float32 or norms[0].item() != 5.0:
            problems.append("torch._foreach_norm(dtype=float32) no longer gives a float32 norm")
    except (AttributeError, RuntimeError, TypeError) as exc:
        problems.append(f"torch._foreach_norm changed: {exc}")
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as exc:
        return [*problems, f"FSDP2 gradient divide factors moved: {exc}"]
    expected = [
        "reduce_scatter_group",
        "all_reduce_group",
        "reduce_dtype",
        "device_type",
        "factor",
        "force_sum_reduction_for_comms",
    ]
    if _signature_names(_get_gradient_divide_factors) != expected:
        problems.append("FSDP2 _get_gradient_divide_factors signature changed")
    init = inspect.getsource(FSDPParamGroup.__init__)
    for attr in ("gradient_divide_factor", "force_sum_reduction_for_comms"):
        if attr not in init:
            problems.append(f"FSDP2 parameter groups no longer keep {attr}")
    return problems


def _check_non_finite_kernel() -> list[str]:
    """The kernel must flag inf and NaN, leave finite values unchanged with an inverse
    scale of 1, and take bfloat16 lists (the watch's bf16 gradients)."""
    try:
        grads = [torch.tensor([1.5, -3.0], dtype=torch.bfloat16), torch.tensor([2.0**-9])]
        found = torch.zeros(1)
        non_finite_check_(grads[:1], found, torch.ones(1))
        non_finite_check_(grads[1:], found, torch.ones(1))
        clean = found.item() == 0.0 and grads[0].tolist() == [1.5, -3.0]
        grads[1][0] = float("inf")
        non_finite_check_(grads[1:], found, torch.ones(1))
        flagged = found.item() == 1.0
    except (AttributeError, RuntimeError, TypeError) as exc:
        return [f"torch._amp_foreach_non_finite_check_and_unscale_ changed: {exc}"]
    if not (clean and flagged):
        return [
            "torch._amp_foreach_non_finite_check_and_unscale_ no longer flags inf/NaN "
            "or no longer leaves values unchanged with an inverse scale of 1"
        ]
    return []


def _check_dtensor() -> list[str]:
    try:
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor._dispatch import found_inf_reduce_handler
    except ImportError as exc:
        return [f"DTensor found-inf handling moved: {exc}"]
    problems = []
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})
    op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
    if handlers.get(op) is not found_inf_reduce_handler:
        problems.append(
            "DTensor no longer reduces found-inf in found_inf_reduce_handler; "
            "ampscope's replica of that reduction (compat.reduce_found_inf) must be revisited"
        )
    source = inspect.getsource(found_inf_reduce_handler)
    if 'Partial("max")' not in source or "full_tensor()" not in source:
        problems.append("found_inf_reduce_handler no longer max-reduces with full_tensor()")
    if "_local_tensor" not in getattr(DTensor, "__annotations__", {}):
        problems.append("DTensor no longer stores its shard in _local_tensor")
    if Partial("max").reduce_op != "max":
        problems.append("torch.distributed.tensor.Partial no longer takes a reduce op")
    return problems


def _check_flat_param() -> list[str]:
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter, _ShardParamInfo
    except ImportError as exc:
        return [f"FSDP1 FlatParameter moved: {exc}"]
    problems = []
    fields = set(getattr(_ShardParamInfo, "_fields", ()))
    if not {"in_shard", "offset_in_shard", "numel_in_shard"} <= fields:
        problems.append(f"FSDP1 _ShardParamInfo fields changed: {sorted(fields)}")
    annotations = getattr(FlatParameter, "__annotations__", {})
    for attr in ("_fqns", "_shard_param_infos"):
        if attr not in annotations:
            problems.append(f"FSDP1 FlatParameter no longer declares {attr}")
    return problems


def _check_hybrid_group() -> list[str]:
    """FSDP1 keeps a hybrid unit's inter-node group (the replicas, ``fsdp1_replica_group``)
    as ``_inter_node_pg``, set where it builds its process groups."""
    from torch.distributed.fsdp import _init_utils

    if "_inter_node_pg" not in inspect.getsource(_init_utils):
        return ["FSDP1 no longer keeps a hybrid unit's inter-node group as _inter_node_pg"]
    return []


def _check_collectives() -> list[str]:
    problems = []
    for hook in ("allreduce_hook", "reduce_scatter_hook", "DefaultState"):
        if not hasattr(fsdp_default_hooks, hook):
            problems.append(f"FSDP1 default comm hooks no longer define {hook}")
    if not callable(getattr(FSDPModule, "set_custom_reduce_scatter", None)):
        problems.append("FSDPModule.set_custom_reduce_scatter no longer exists")
    if not callable(getattr(FSDPModule, "_get_fsdp_state", None)):
        problems.append("FSDPModule._get_fsdp_state no longer exists")
    for method in ("allocate", "__call__"):
        if not hasattr(ReduceScatter, method):
            problems.append(f"FSDP2 ReduceScatter comm no longer has {method}")
    if "shard_mesh_size" not in inspect.getsource(FSDPMeshInfo):
        problems.append("FSDPMeshInfo no longer has shard_mesh_size")
    if "mesh" not in {field.name for field in dataclasses.fields(FSDPMeshInfo)}:
        problems.append("FSDPMeshInfo no longer keeps its data-parallel mesh as mesh")
    ddp_init = inspect.getsource(DDP.__init__) + inspect.getsource(DDP.register_comm_hook)
    for attr in ("_comm_hooks", "_use_python_reducer"):
        if attr not in ddp_init and attr not in inspect.getsource(DDP):
            problems.append(f"DistributedDataParallel no longer keeps {attr}")
    fsdp_source = inspect.getsource(FSDP)
    for attr in ("_comm_hook", "_comm_hook_state"):
        if attr not in fsdp_source:
            problems.append(f"FullyShardedDataParallel no longer keeps {attr}")
    return problems
