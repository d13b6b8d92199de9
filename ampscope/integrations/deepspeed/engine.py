"""Every read of a DeepSpeed engine's state, in one place (DeepSpeed 0.19.8).

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

Where DeepSpeed reduces the gradients is read here too, so that ampscope checks this
rank's own gradients right before they are reduced:

* ZeRO-0 (``FP16_Optimizer``, fp32) and ZeRO-1 (without ``overlap_comm`` or an fp32
  accumulation attribute), a ``PipelineEngine``'s included, keep them in the parameters'
  ``.grad``, accumulated over the micro-batches, until one reduction inside
  ``engine.allreduce_gradients()`` at the accumulation boundary
  (:func:`reduces_at_boundary_only`, :func:`check_before_reduction`);
* ZeRO-2's ``DeepSpeedZeroOptimizer`` copies each micro-batch's fresh gradients into
  buckets (``ipg_buckets[dtype].grads``, ``.params``) and reduces each full bucket in
  ``reduce_ipg_grads``; after every backward it clears ``.grad`` (its accumulation is of
  the reduced partitions), so a bucket holds this rank's own gradients of this micro-batch
  only (:func:`reduces_per_bucket`, :func:`check_each_bucket`);
* ZeRO-3's ``DeepSpeedZeroOptimizer_Stage3`` adds each parameter's fresh gradient to a
  bucket (``ipg_buckets[comm dtype].params``; the gradient stays ``param.grad``, copied
  into the bucket's ``buffer`` when it fits, the "extra large" one left where it is) when
  its accumulation hook fires, and reduces a bucket through a name-mangled private method,
  ``__reduce_and_partition_ipg_grads`` (the instance attribute
  ``_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads``, looked up on the
  instance by every call: before a bucket would overflow, before one of another process
  group, and for every bucket left at the end of backward,
  ``independent_gradient_partition_epilogue``). That method sets ``.grad`` to ``None``
  after the reduce-scatter, so a bucket holds this rank's own gradients of this micro-batch
  only (:func:`reduces_per_partition_bucket`, :func:`check_each_partition_bucket`; the
  check runs on the optimizer's ``reduce_and_partition_stream``, where DeepSpeed copies
  the gradients into the buffer under ``overlap_comm``);
* the other paths (``BF16_Optimizer``, ZeRO-2/3 with offload, ZenFlow) move or reduce
  gradients elsewhere: ampscope keeps one tensor hook per parameter there rather than
  patch them.

Every wrap is an instance attribute whose removal restores DeepSpeed's method, and every
read is guarded: a release that moves these makes :func:`reduces_at_boundary_only`,
:func:`reduces_per_bucket` and :func:`reduces_per_partition_bucket` say ``False`` (the
per-parameter hooks, slower but correct), and
``tests/integrations/test_deepspeed.py`` fail.

For DeepSpeed's ``PipelineEngine``, whose ``train_batch()`` takes the optimizer step without
``step()``: the method its ``OptimizerStep`` instruction calls (``_take_model_step``) and the
last stage's micro-batch losses (``fwd_outputs``), read in the functions at the end.
``tests/integrations/test_deepspeed.py`` and ``test_deepspeed_pipe.py`` fail when a release
moves any of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from ampscope.rank import compat

BucketCheck = Callable[[list[torch.Tensor], tuple[int, ...]], None]
"""Called with a bucket's gradients and DeepSpeed's ids of their parameters, in order."""

_PARAM_ID = operator.itemgetter(2)
"""A ZeRO-1/2 bucket entry is ``(group index, index in group, param id)``."""


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


def reduces_at_boundary_only(engine: Any) -> bool:
    """Whether the engine leaves this rank's gradients in the parameters' ``.grad`` (summed
    over the micro-batches by autograd) until one reduction in ``allreduce_gradients()`` at
    the accumulation boundary, so that one check there sees every micro-batch's own
    gradients before any rank's are mixed in.

    True for ZeRO-0 (fp32, or ``FP16_Optimizer`` under fp16 and bf16: its ``zero_grad``
    runs in ``step()`` only) and for ZeRO-1's ``DeepSpeedZeroOptimizer`` without
    ``overlap_comm`` (which reduces inside the boundary micro-batch's backward) and without
    ``use_grad_accum_attribute`` (fp32 accumulation, which moves ``.grad`` into
    ``param.grad_accum`` after the reduction call). The same for a ``PipelineEngine``, whose
    ``train_batch()`` reduces through ``allreduce_gradients()`` in its ``ReduceGrads``
    instruction (the boundary forced). False for ZeRO-2/3 (they reduce bucket by bucket
    during every backward), ``BF16_Optimizer`` (it copies each micro-batch's gradient into
    an fp32 buffer and clears ``.grad``), engines that reduce elsewhere
    (``enable_backward_allreduce`` off; DeepCompile; ZenFlow), and anything this module
    does not recognise."""
    try:
        if not callable(getattr(engine, "allreduce_gradients", None)):
            return False
        if getattr(engine, "zenflow", False):
            return False
        if is_pipeline(engine):
            # train_batch() reduces in its ReduceGrads instruction, through
            # allreduce_gradients() with the boundary forced (BF16_Optimizer aside: below).
            if engine.pipeline_enable_backward_allreduce is not True:
                return False
        elif engine.enable_backward_allreduce is not True:
            return False
        if engine.is_deepcompile_active():
            return False
        if engine.zero_optimization_partition_gradients():
            return False
        optimizer = engine.optimizer
        if hasattr(optimizer, "fp32_groups_gradients"):  # BF16_Optimizer
            return False
        stage = int(engine.zero_optimization_stage())
        if stage == 0:
            return True
        if stage == 1 and type(optimizer).__name__ == "DeepSpeedZeroOptimizer":
            return optimizer.overlap_comm is False and optimizer.use_grad_accum_attribute is False
    except Exception:  # a release that moved these: keep the per-parameter hooks
        return False
    return False


def check_before_reduction(
    engine: Any, check: Callable[[], None], after: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Wrap ``engine.allreduce_gradients`` (an instance attribute; DeepSpeed's method runs
    unchanged) so that ``check`` runs first whenever it is called at an accumulation
    boundary: the engine's backward calls it after every micro-batch, and ``step()`` calls
    it at the boundary under unmanaged accumulation. ``after``, if given, runs right after
    it there, on the reduced ``.grad``s (before the optimizer step). Neither may raise.

    Returns:
        A function that removes the wrap (idempotent).
    """
    own_attribute = engine.__dict__.get("allreduce_gradients")
    own = engine.allreduce_gradients
    boundary = engine.is_gradient_accumulation_boundary

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        if not boundary():
            return own(*args, **kwargs)
        check()
        result = own(*args, **kwargs)
        if after is not None:
            after()
        return result

    engine.allreduce_gradients = allreduce_gradients

    def unwrap() -> None:
        if engine.__dict__.get("allreduce_gradients") is not allreduce_gradients:
            return  # already removed, or wrapped again by someone else: leave theirs
        if own_attribute is None:
            del engine.allreduce_gradients
        else:
            engine.allreduce_gradients = own_attribute

    return unwrap


def reduces_per_bucket(engine: Any) -> bool:
    """Whether the engine is ZeRO-2 on ``DeepSpeedZeroOptimizer`` as read here (see the
    module docstring): every gradient reduced through ``reduce_ipg_grads`` from an
    ``ipg_buckets`` bucket that holds only this micro-batch's own gradients. False for CPU
    offload, ZenFlow, an fp32 accumulation attribute, a coalesced reduction, DeepCompile,
    and anything this module does not recognise."""
    try:
        optimizer = engine.optimizer
        if type(optimizer).__name__ != "DeepSpeedZeroOptimizer":
            return False
        if int(engine.zero_optimization_stage()) != 2 or engine.is_deepcompile_active():
            return False
        if getattr(engine, "zenflow", False) or getattr(optimizer, "zenflow", False):
            return False
        flags = ("cpu_offload", "use_grad_accum_attribute", "_coalesce_grad_reduction")
        if any(getattr(optimizer, name) is not False for name in flags):
            return False
        if optimizer.partition_gradients is not True:
            return False
        return callable(optimizer.reduce_ipg_grads) and isinstance(optimizer.ipg_buckets, dict)
    except Exception:  # a release that moved these: keep the per-parameter hooks
        return False


def param_id(engine: Any) -> Callable[[torch.Tensor], int]:
    """DeepSpeed's id of a parameter, as its ZeRO-1/2 buckets name them (``get_param_id``)."""
    get: Callable[[torch.Tensor], int] = engine.optimizer.get_param_id
    return get


def check_each_bucket(engine: Any, check: BucketCheck) -> Callable[[], None]:
    """Wrap the ZeRO-2 optimizer's ``reduce_ipg_grads`` (an instance attribute; DeepSpeed's
    method runs unchanged) so that ``check`` sees every bucket it is about to reduce: the
    bucket's gradient list and its parameters' ids (read in C, no Python per parameter).
    ``check`` must not raise.

    Returns:
        A function that removes the wrap (idempotent).
    """
    optimizer = engine.optimizer
    own_attribute = optimizer.__dict__.get("reduce_ipg_grads")
    own = optimizer.reduce_ipg_grads
    buckets = optimizer.ipg_buckets

    def reduce_ipg_grads(*args: Any, **kwargs: Any) -> Any:
        comm_dtype = kwargs.get("comm_dtype", args[0] if args else None)
        for dtype in list(buckets) if comm_dtype is None else [comm_dtype]:
            bucket = buckets.get(dtype)
            if bucket is not None and bucket.grads:
                check(bucket.grads, tuple(map(_PARAM_ID, bucket.params)))
        return own(*args, **kwargs)

    optimizer.reduce_ipg_grads = reduce_ipg_grads

    def unwrap() -> None:
        if optimizer.__dict__.get("reduce_ipg_grads") is not reduce_ipg_grads:
            return  # already removed, or wrapped again by someone else: leave theirs
        if own_attribute is None:
            del optimizer.reduce_ipg_grads
        else:
            optimizer.reduce_ipg_grads = own_attribute

    return unwrap


_ZERO3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
"""ZeRO-3's ``self.__reduce_and_partition_ipg_grads``, as Python's name mangling spells it:
an ordinary attribute lookup on the optimizer, so an instance attribute takes every call."""

_DS_ID = operator.attrgetter("ds_id")
"""ZeRO-3's id of a parameter (``param.ds_id``), as its buckets and ``get_param_id`` name it."""

_GRAD = operator.attrgetter("grad")

_StreamContext = Callable[[], AbstractContextManager[Any]]


def _stream_context(stream: Any) -> _StreamContext | None:
    """How to run work on ZeRO-3's ``reduce_and_partition_stream``: nothing to do on a
    synchronized device (``None``: DeepSpeed's CPU accelerator), ``torch.cuda.stream`` on a
    CUDA stream (the side stream under ``overlap_comm``, the default one without);
    ``None`` for any other stream (not recognised)."""
    if stream is None:
        return contextlib.nullcontext
    if isinstance(stream, torch.cuda.Stream):
        return functools.partial(torch.cuda.stream, stream)
    return None


def reduces_per_partition_bucket(engine: Any, params: Iterable[torch.Tensor]) -> bool:
    """Whether the engine is ZeRO-3 on ``DeepSpeedZeroOptimizer_Stage3`` as read here (see
    the module docstring): every gradient of ``params`` (the module's) reduced through
    ``__reduce_and_partition_ipg_grads`` from an ``ipg_buckets`` bucket that holds only this
    micro-batch's own gradients, each parameter named by its ``ds_id``. False for optimizer
    or parameter offload (and SuperOffload, a subclass), ZenFlow, DeepCompile, AutoEP's
    folded tensor parallelism (its correction all-reduces a gradient over the tensor-parallel
    group before it reaches a bucket), a reduction stream other than CUDA's, and anything
    this module does not recognise."""
    try:
        optimizer = engine.optimizer
        if type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3":
            return False
        if int(engine.zero_optimization_stage()) != 3 or engine.is_deepcompile_active():
            return False
        if getattr(engine, "zenflow", False) or optimizer.zenflow is not False:
            return False
        flags = ("offload_optimizer", "offload_param", "_coalesce_grad_reduction")
        if any(getattr(optimizer, name) is not False for name in flags):
            return False
        if optimizer.autoep_folding_tp_group is not None:
            return False
        if _stream_context(optimizer.reduce_and_partition_stream) is None:
            return False
        if not callable(getattr(optimizer, _ZERO3_REDUCE)):
            return False
        if not isinstance(optimizer.ipg_buckets, dict):
            return False
        return all(isinstance(getattr(p, "ds_id", None), int) for p in params if p.requires_grad)
    except Exception:  # a release that moved these: keep the per-parameter hooks
        return False


def partition_param_id(param: torch.Tensor) -> int:
    """ZeRO-3's id of a parameter (``ds_id``), as its buckets name them."""
    value: int = _DS_ID(param)
    return value


def check_each_partition_bucket(engine: Any, check: BucketCheck) -> Callable[[], None]:
    """Wrap the ZeRO-3 optimizer's ``__reduce_and_partition_ipg_grads`` (an instance
    attribute; DeepSpeed's method runs unchanged) so that ``check`` sees every bucket it is
    about to reduce: its parameters' gradients and ``ds_id`` (read in C, no Python per
    parameter), on the optimizer's reduction stream, the one DeepSpeed wrote the bucket's
    buffer on and reduces it on (no sync). ``check`` must not raise.

    Returns:
        A function that removes the wrap (idempotent).

    Raises:
        ValueError: the reduction stream is not one :func:`reduces_per_partition_bucket`
            recognises.
    """
    optimizer = engine.optimizer
    on_stream = _stream_context(optimizer.reduce_and_partition_stream)
    if on_stream is None:
        raise ValueError("ZeRO-3's reduction stream is not recognised")
    own_attribute = optimizer.__dict__.get(_ZERO3_REDUCE)
    own = getattr(optimizer, _ZERO3_REDUCE)

    def reduce_and_partition_ipg_grads(*args: Any, **kwargs: Any) -> Any:
        dtype = kwargs.get("communication_data_type", args[0] if args else None)
        bucket = optimizer.ipg_buckets.get(dtype)
        params = None if bucket is None else bucket.params
        if params:
            with on_stream():
                check(list(map(_GRAD, params)), tuple(map(_DS_ID, params)))
        return own(*args, **kwargs)

    setattr(optimizer, _ZERO3_REDUCE, reduce_and_partition_ipg_grads)

    def unwrap() -> None:
        if optimizer.__dict__.get(_ZERO3_REDUCE) is not reduce_and_partition_ipg_grads:
            return  # already removed, or wrapped again by someone else: leave theirs
        if own_attribute is None:
            delattr(optimizer, _ZERO3_REDUCE)
        else:
            setattr(optimizer, _ZERO3_REDUCE, own_attribute)

    return unwrap


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
