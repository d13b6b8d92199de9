"""Where DeepSpeed reduces the gradients (DeepSpeed 0.19.8), read and wrapped in one
place, so that ampscope checks this rank's own gradients right before they are reduced:

* ZeRO-0 (``FP16_Optimizer``, fp32) and ZeRO-1 (without ``overlap_comm`` or an fp32
  accumulation attribute), a ``PipelineEngine``'s without weights tied across stages
  included, keep them in the parameters'
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
* the other paths move or reduce gradients elsewhere (``BF16_Optimizer``, ZeRO-1 with
  ``overlap_comm`` or an fp32 accumulation attribute, ZeRO-2/3 with offload, ZenFlow,
  DeepCompile, AutoEP's folded tensor parallelism, a ZeRO-3 reduction stream that is not
  CUDA's, ``enable_backward_allreduce`` off), or mix other ranks' values in before the
  data-parallel reduction (a ``PipelineEngine`` whose weights are tied across stages):
  ampscope keeps one tensor hook per parameter there rather than patch them.

Every wrap is an instance attribute whose removal restores DeepSpeed's method, and every
read is guarded: a release that moves these makes :func:`reduces_at_boundary_only`,
:func:`reduces_per_bucket` and :func:`reduces_per_partition_bucket` say ``False`` (the
per-parameter hooks, slower but correct), and
``tests/integrations/test_deepspeed.py`` fail.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from ampscope.integrations.deepspeed.engine import is_pipeline, tied_across_stages

BucketCheck = Callable[[list[torch.Tensor], tuple[int, ...]], None]
"""Called with a bucket's gradients and DeepSpeed's ids of their parameters, in order."""

_PARAM_ID = operator.itemgetter(2)
"""A ZeRO-1/2 bucket entry is ``(group index, index in group, param id)``."""


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
            # allreduce_gradients() with the boundary forced (BF16_Optimizer aside: below);
            # tied weights are all-reduced across stages before it (ReduceTiedGrads), so
            # a check there would see another stage's gradients in them: the hooks.
            if engine.pipeline_enable_backward_allreduce is not True:
                return False
            if tied_across_stages(engine):
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

    Inside ``engine.coalesce_grad_reduction()`` (ZeRO-1) the backward skips that call and
    the block's exit reduces every gradient instead: ``coalesce_grad_reduction`` is wrapped
    too, so that ``check`` runs at the end of the block, before DeepSpeed's exit reduces.

    Returns:
        A function that removes the wraps (idempotent).
    """
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

    unwraps = [_install(engine, "allreduce_gradients", allreduce_gradients)]
    coalesce = getattr(engine, "coalesce_grad_reduction", None)
    if callable(coalesce):

        @contextlib.contextmanager
        def coalesce_grad_reduction(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with coalesce(*args, **kwargs) as block:
                yield block
                check()  # the block's backwards are done; DeepSpeed reduces on its exit

        unwraps.append(_install(engine, "coalesce_grad_reduction", coalesce_grad_reduction))

    def unwrap() -> None:
        for one in unwraps:
            one()

    return unwrap


def _install(owner: Any, name: str, wrapper: Any) -> Callable[[], None]:
    """Set ``wrapper`` as ``owner``'s instance attribute ``name`` (over DeepSpeed's method);
    returns the idempotent removal, which restores what the instance held before (or the
    class's method) and leaves alone a wrap someone else installed over ours."""
    had = name in owner.__dict__
    before = owner.__dict__.get(name)
    setattr(owner, name, wrapper)

    def unwrap() -> None:
        if owner.__dict__.get(name) is not wrapper:
            return  # already removed, or wrapped again by someone else: leave theirs
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)

    return unwrap


def reduces_per_bucket(engine: Any) -> bool:
    """Whether the engine is ZeRO-2 on ``DeepSpeedZeroOptimizer`` as read here (see the
    module docstring): every gradient reduced through ``reduce_ipg_grads`` from an
    ``ipg_buckets`` bucket that holds only this micro-batch's own gradients. False for CPU
    offload, ZenFlow, an fp32 accumulation attribute, a coalesced reduction, DeepCompile,
    and anything this module does not recognise."""
    try:
        flags = ("zenflow", "cpu_offload", "use_grad_accum_attribute", "_coalesce_grad_reduction")
        optimizer = _plain_zero_optimizer(engine, "DeepSpeedZeroOptimizer", 2, flags)
        if optimizer is None or optimizer.partition_gradients is not True:
            return False
        return callable(optimizer.reduce_ipg_grads) and isinstance(optimizer.ipg_buckets, dict)
    except Exception:  # a release that moved these: keep the per-parameter hooks
        return False


def _plain_zero_optimizer(engine: Any, kind: str, stage: int, off: tuple[str, ...]) -> Any:
    """The engine's ZeRO optimizer when it is exactly ``kind`` (no subclass) at ``stage``,
    without DeepCompile or ZenFlow, and each attribute in ``off`` is ``False``; else
    ``None``. Raises where a release moved these (the callers keep the hooks then)."""
    optimizer = engine.optimizer
    if type(optimizer).__name__ != kind or int(engine.zero_optimization_stage()) != stage:
        return None
    if engine.is_deepcompile_active() or getattr(engine, "zenflow", False):
        return None
    if any(getattr(optimizer, name) is not False for name in off):
        return None
    return optimizer


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
    own = optimizer.reduce_ipg_grads
    buckets = optimizer.ipg_buckets

    def reduce_ipg_grads(*args: Any, **kwargs: Any) -> Any:
        comm_dtype = kwargs.get("comm_dtype", args[0] if args else None)
        for dtype in list(buckets) if comm_dtype is None else [comm_dtype]:
            bucket = buckets.get(dtype)
            if bucket is not None and bucket.grads:
                check(bucket.grads, tuple(map(_PARAM_ID, bucket.params)))
        return own(*args, **kwargs)

    return _install(optimizer, "reduce_ipg_grads", reduce_ipg_grads)


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
        flags = ("zenflow", "offload_optimizer", "offload_param", "_coalesce_grad_reduction")
        optimizer = _plain_zero_optimizer(engine, "DeepSpeedZeroOptimizer_Stage3", 3, flags)
        if optimizer is None or optimizer.autoep_folding_tp_group is not None:
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
    own = getattr(optimizer, _ZERO3_REDUCE)

    def reduce_and_partition_ipg_grads(*args: Any, **kwargs: Any) -> Any:
        dtype = kwargs.get("communication_data_type", args[0] if args else None)
        bucket = optimizer.ipg_buckets.get(dtype)
        params = None if bucket is None else bucket.params
        if params:
            with on_stream():
                check(list(map(_GRAD, params)), tuple(map(_DS_ID, params)))
        return own(*args, **kwargs)

    return _install(optimizer, _ZERO3_REDUCE, reduce_and_partition_ipg_grads)
