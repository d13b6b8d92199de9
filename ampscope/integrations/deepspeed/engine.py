"""Every read of a DeepSpeed engine's state, in one place (DeepSpeed 0.19.8); where it
reduces the gradients, and the wraps there: :mod:`~ampscope.integrations.deepspeed.reduction`.

The engine's public surface says what DeepSpeed decided at a gradient-accumulation
boundary: ``was_step_applied()``, ``skipped_steps``, ``get_global_grad_norm()`` and
``is_gradient_accumulation_boundary()``. The loss scale and the overflow flag sit on the
optimizer DeepSpeed built (``engine.optimizer``): ``overflow`` (every ZeRO stage, and
``BF16_Optimizer``; stale between boundaries), the scale as ``cur_scale`` (ZeRO 1-3
fp16) or ``loss_scale`` (ZeRO-0's ``FP16_Optimizer``), and the dynamic loss scaler's
iteration counters (``loss_scaler.cur_iter``, ``last_overflow_iter``, ``scale_window``)
for the growth tracker. The ``torch_autocast`` fp16 mode scales with a torch
``GradScaler`` of DeepSpeed's instead: the engine's ``torch_autocast_z0_gradscaler`` at
ZeRO-0, the ZeRO optimizer's ``torch_autocast_gradscaler`` at ZeRO 1-3. For the replica
check: the ZeRO stage (``zero_optimization_stage()``), the group the parameters are
replicated over (``seq_data_parallel_group``: DeepSpeed's data-parallel group, widened by
sequence parallelism; the group it broadcasts the parameters over at start and reduces the
gradients over) and, for MoE experts, ``expert_data_parallel_group[param.group_name]``.
``tests/integrations/test_deepspeed.py`` fails when a release moves any of them.

For DeepSpeed's ``PipelineEngine``, whose ``train_batch()`` takes the optimizer step without
``step()``: the method its ``OptimizerStep`` instruction calls (``_take_model_step``) and the
last stage's micro-batch losses (``fwd_outputs``), read in the functions at the end.
``tests/integrations/test_deepspeed.py`` and ``test_deepspeed_pipe.py`` fail when a release
moves any of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ampscope.rank import compat


def fp16(engine: Any) -> bool:
    """Whether the engine scales the loss with its own loss scaler (``"fp16"`` config)."""
    return bool(engine.fp16_enabled())


def autocast_scaler(engine: Any) -> torch.amp.GradScaler | None:
    """The torch ``GradScaler`` DeepSpeed built for ``"torch_autocast": {"dtype":
    "float16"}`` (the engine's at ZeRO-0, the ZeRO optimizer's at ZeRO 1-3); ``None``
    under any other precision. Asked of the engine's own config: DeepSpeed keeps the
    autocast setting process-wide, so a ZeRO optimizer built after a ``torch_autocast``
    engine in the same process gets a ``GradScaler`` too, whatever its config says."""
    enabled = getattr(engine, "torch_autocast_enabled", None)  # absent from older releases
    if not (callable(enabled) and enabled()):
        return None
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is None:
        scaler = getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def autocast_norm_is_scaled(engine: Any) -> bool:
    """Whether ``get_global_grad_norm()`` is of the gradients still multiplied by the
    ``torch_autocast`` scaler's scale: at ZeRO 1-3, whose optimizer divides the norm by its
    own loss scale (1 there), not by the ``GradScaler``'s."""
    return (
        autocast_scaler(engine) is not None
        and getattr(engine.optimizer, "torch_autocast_gradscaler", None) is not None
    )


def checks_overflow(engine: Any) -> bool:
    """Whether DeepSpeed is configured to skip a step whose gradients hold inf/NaN: under
    fp16 always, under bf16 unless ``"bf16": {"check_grad_overflow": false}``, under fp32
    at ZeRO 1-3 on a non-finite norm (at ZeRO-0 the user's optimizer steps regardless: the
    monitor learns it from the first such step)."""
    if fp16(engine) or not engine.bfloat16_enabled():
        return True
    bf16 = getattr(getattr(engine, "_config", None), "bfloat16_config", None)
    return bool(getattr(bf16, "check_grad_overflow", True))


def loss_scale(engine: Any) -> float:
    """The loss scale in use; 1.0 when the engine does not scale (bf16, fp32). The
    ``torch_autocast`` scaler's is a tensor: read, one host-device sync on an
    accelerator (the monitor takes :func:`scale_now` instead)."""
    if not fp16(engine):
        scaler = autocast_scaler(engine)
        return 1.0 if scaler is None else float(scaler.get_scale())
    return _fp16_scale(engine)


def _fp16_scale(engine: Any) -> float:
    optimizer = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    scaler = getattr(optimizer, "loss_scaler", None)
    value = getattr(scaler, "cur_scale", None)
    return float(value) if isinstance(value, (int, float)) else 1.0


def optimizer_step_call(engine: Any) -> bool:
    """Whether the ``step()`` about to be called takes an optimizer step: at the
    gradient-accumulation boundary, or at every call under ``"managed_gradient_accumulation":
    false``, where the caller owns the boundary and DeepSpeed says "boundary" only while
    ``step()`` runs."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and managed() is False:
        return True
    return bool(engine.is_gradient_accumulation_boundary())


def scale_now(engine: Any) -> float | torch.Tensor:
    """The loss scale in use, taken without waiting for the device (before and after
    ``step()``): the ``torch_autocast`` scaler's as a copy on its device (its ``update()``
    inside ``step()`` rewrites the tensor in place), read on the telemetry thread; fp16's
    as the Python float DeepSpeed holds; 1.0 under bf16 and fp32."""
    if fp16(engine):
        return _fp16_scale(engine)
    scaler = autocast_scaler(engine)
    if scaler is None:
        return 1.0
    scale = compat.scale_tensor(scaler)
    return float(scaler.get_scale()) if scale is None else scale.detach().clone()


def overflow(engine: Any) -> bool:
    """DeepSpeed's verdict on the boundary step just taken: its gradients (after the
    reduction) held inf/NaN. Read right after ``step()`` at a boundary (stale otherwise);
    an optimizer without the flag as a bool: the step was not applied. Host state only."""
    flag = getattr(engine.optimizer, "overflow", None)
    if isinstance(flag, bool):
        return flag
    return not engine.was_step_applied()


def gives_global_verdict(engine: Any) -> bool:
    """Whether DeepSpeed itself says, on every rank, that the reduced gradients held
    inf/NaN: an optimizer with an ``overflow`` flag or a global norm
    (``_global_grad_norm``, which ``get_global_grad_norm()`` reports), fp16, or a
    ``torch_autocast`` GradScaler (which skips on every rank). False at ZeRO-0 in fp32,
    where the user's torch optimizer steps on whatever the reduction left."""
    if fp16(engine) or autocast_scaler(engine) is not None:
        return True
    optimizer = engine.optimizer
    return hasattr(optimizer, "overflow") or hasattr(optimizer, "_global_grad_norm")


def grad_norm(engine: Any) -> float | torch.Tensor | None:
    """The global gradient norm of the boundary step just taken, unread: a float, or a
    0-dim tensor (fp64 at ZeRO-3) that the monitor reads on its telemetry thread; ``inf``
    on an overflow; ``None`` when DeepSpeed computed none."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return norm.detach() if isinstance(norm, torch.Tensor) else float(norm)


ScalerCounters = tuple[int, int, int]
"""DeepSpeed's dynamic loss scaler's ``cur_iter``, ``last_overflow_iter``, ``scale_window``."""


def scaler_counters(engine: Any) -> ScalerCounters | None:
    """The fp16 dynamic loss scaler's iteration counters right after ``step()`` (host
    ints; ``None`` where there are none: a static scale, another precision), for
    :func:`growth_tracker` on the telemetry thread."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    current = getattr(scaler, "cur_iter", None)
    last = getattr(scaler, "last_overflow_iter", None)
    window = getattr(scaler, "scale_window", None)
    if isinstance(current, int) and isinstance(last, int) and isinstance(window, int):
        return current, last, window
    return None


def growth_tracker(
    counters: ScalerCounters | None, found: bool, before: float, after: float
) -> int:
    """Clean steps since the scale last changed, as torch's growth tracker counts them:
    0 right after a backoff or a growth, so that a record's event reads as a scaler's.

    DeepSpeed's dynamic scaler grows after ``scale_window`` clean steps past its last
    overflow, counting from ``last_overflow_iter`` (``counters``: :func:`scaler_counters`
    of the step); a static scale never grows. (Not for ``torch_autocast`` fp16: its
    ``GradScaler``'s tracker counts ``update()`` calls, one per parameter group or ZeRO-3
    sub-group and step; the monitor counts steps itself.)
    """
    if found or after > before:
        return 0
    if counters is None:
        return 1
    current, last, window = counters
    if window < 1:
        return 1
    clean = current - last - 1  # clean update()s since the last overflow, this one included
    return max(1, clean if clean <= window else (clean - 1) % window or window)


def finite(value: float | None) -> bool:
    """``value`` is a finite number (``None``: nothing to judge, finite)."""
    return value is None or math.isfinite(value)


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0-3)."""
    return int(engine.zero_optimization_stage())


def replicated_parameters(engine: Any, module: Any) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """``module``'s parameters that every rank of a group holds whole, each with that
    group, in ``named_parameters()`` order: the ones DeepSpeed's ``_broadcast_model``
    makes identical at start. Dense parameters: the (sequence-)data-parallel group; an
    MoE expert's (``param.allreduce`` false): its expert data-parallel group. Left out:
    ZeRO-3's partitioned parameters (``ds_status``) and ``OptimizedLinear``'s
    per-shard weights (``ds_optim_param``), as DeepSpeed leaves them out.
    """
    dense = engine.seq_data_parallel_group
    experts = getattr(engine, "expert_data_parallel_group", None) or {}
    for name, param in module.named_parameters():
        if hasattr(param, "ds_status") or hasattr(param, "ds_optim_param"):
            continue
        if not getattr(param, "allreduce", True):  # deepspeed.moe.utils.is_moe_param
            group = experts.get(getattr(param, "group_name", None))
            if group is not None:
                yield name, param, group
            continue
        yield name, param, dense


# -- PipelineEngine ------------------------------------------------------------------------
# ``train_batch()`` runs the whole batch from a schedule of instructions, dispatched through
# the class's ``_INSTRUCTION_MAP`` (an instance attribute cannot replace one of them): the
# last stage's backward calls ``DeepSpeedEngine.backward`` directly, and the ``OptimizerStep``
# instruction (``_exec_optimizer_step``) calls ``self._take_model_step(lr_kwargs)`` with the
# boundary forced (``is_gradient_accumulation_boundary()`` true), once per batch on every
# rank. The engine's own ``backward()`` and ``step()`` raise ``PipelineError``.


def is_pipeline(engine: Any) -> bool:
    """Whether ``engine`` is DeepSpeed's ``PipelineEngine`` (or a subclass), known by its
    class name: DeepSpeed is never imported."""
    return any(cls.__name__ == "PipelineEngine" for cls in type(engine).__mro__)


def pipeline_step(engine: Any) -> Any:
    """The pipeline engine's optimizer step as its ``OptimizerStep`` instruction calls it
    (``_take_model_step``, a bound method).

    Raises:
        NotImplementedError: this release has no such method (the observation would see
            nothing).
    """
    own = getattr(engine, "_take_model_step", None)
    if not callable(own):
        raise NotImplementedError(
            "ampscope cannot observe this DeepSpeed PipelineEngine: its optimizer step "
            "(_take_model_step, which train_batch() calls) is not where ampscope knows it "
            "(DeepSpeed 0.19.8). Use a DeepSpeed release ampscope supports, or train "
            "without pipeline stages (a DeepSpeedEngine's step() is observed)"
        )
    return own


def route_pipeline_step(engine: Any, observed: Any) -> None:
    """Make the pipeline engine's ``train_batch()`` take its optimizer step through
    ``observed`` (an instance attribute over :func:`pipeline_step`'s method)."""
    engine._take_model_step = observed


def pipeline_losses(engine: Any) -> list[torch.Tensor]:
    """This stage's losses of the batch being trained, one per micro-batch, unscaled and
    detached: the last stage's forward passes keep them in ``fwd_outputs`` (reset by each
    ``train_batch()``); the other stages compute none. Read within the optimizer step. A
    loss that is a tuple of tensors is left out (not one loss value)."""
    if not engine.is_last_stage():
        return []
    return [loss for loss in getattr(engine, "fwd_outputs", ()) if isinstance(loss, torch.Tensor)]


def tied_across_stages(engine: Any) -> bool:
    """Whether a pipeline engine's module ties weights across stages (``TiedLayerSpec``:
    ``train_batch()`` all-reduces their gradients between the stages that hold them,
    ``ReduceTiedGrads``, before its data-parallel reduction). Unknown: ``True``."""
    tied = getattr(getattr(engine, "module", None), "tied_comms", None)
    return not isinstance(tied, dict) or bool(tied)


def stepped_parameters(engine: Any) -> set[int] | None:
    """The ids of the parameters DeepSpeed's optimizer steps, whose gradients it zeroes after
    each step: ZeRO-1/2's ``bit16_groups``, ZeRO-3's and ``FP16_Optimizer``'s
    ``fp16_groups``, ``BF16_Optimizer``'s ``bf16_groups``, else the
    optimizer's ``param_groups`` (a torch optimizer at ZeRO-0); ``None`` when none of them
    reads as lists of tensors. A parameter that requires a gradient but was not given to
    ``deepspeed.initialize`` keeps summing its ``.grad`` over every step (nothing zeroes
    it), and says nothing about the step DeepSpeed takes."""
    optimizer = getattr(engine, "optimizer", None)
    for name in ("bit16_groups", "fp16_groups", "bf16_groups"):
        groups = getattr(optimizer, name, None)
        if isinstance(groups, list) and groups and all(isinstance(g, list) for g in groups):
            return {id(p) for group in groups for p in group if isinstance(p, torch.Tensor)}
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and groups:
        try:
            return {id(p) for group in groups for p in group["params"]}
        except (KeyError, TypeError):
            return None
    return None


def inside_no_sync(engine: Any) -> bool:
    """Whether the engine is inside ``no_sync()`` or ``coalesce_grad_reduction()`` (where
    ``step()`` raises and the backwards do not reduce)."""
    return getattr(engine, "inside_no_sync_ctxt", False) is True
