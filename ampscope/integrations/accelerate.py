"""Hugging Face Accelerate: ``instrument(accelerator)`` swaps in ampscope's scaler.

Accelerate keeps its scaler in ``accelerator.scaler`` and hands it to every optimizer
wrapper (``AcceleratedOptimizer.scaler``) in ``prepare()``; its own ``backward()``,
``clip_grad_norm_()`` and ``unscale_gradients()`` read ``accelerator.scaler``. The swap
replaces it in all of those places, with the same class Accelerate chose
(``torch.amp.GradScaler`` for DDP, FSDP2 and one device, ``ShardedGradScaler`` for FSDP1).

With ``mixed_precision="bf16"`` or ``"no"`` Accelerate has no scaler; ``instrument`` puts a
:class:`~ampscope.GradWatch` in that place instead. Accelerate then runs its scaler code
path with it: ``backward()`` calls ``scale()`` (the loss unchanged), each
``AcceleratedOptimizer.step()`` calls the watch's ``step()`` and ``update()``, and notes
``step_was_skipped`` when the watch did not call the optimizer's ``step()`` (policy
``skip``), which holds the ``AcceleratedScheduler``.

On DeepSpeed (``accelerate launch`` with a DeepSpeed config, or a ``DeepSpeedPlugin``)
the engine scales, checks and skips inside itself, out of a scaler swap's reach:
``instrument`` returns a :class:`~ampscope.integrations.deepspeed.DeepSpeedMonitor`
instead, bound to the engine ``prepare()`` builds (or built), as
``ampscope.integrations.deepspeed.instrument(engine)`` would.

Batch ids: the training loop is the user's and Accelerate has no per-batch hook (its
prepared data loader yields batches already on the device, and exposes no sample indices),
so the loop notes them in one line, ``note_ids(scaler, batch)``, re-exported here from
:mod:`ampscope.integrations._batch`: the ids of a batch holding ``"sample_ids"``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from ampscope.integrations._batch import note_ids
from ampscope.integrations._swap import (
    NO_SCALER,
    WATCHING,
    Attacher,
    check_options,
    check_policy,
    is_distributed,
    make_watch,
    twin,
    warn_if_sinks_reused,
)
from ampscope.rank.config import WatchConfig
from ampscope.rank.frontends.base import TelemetryFrontEnd
from ampscope.reporter.schema import Policy

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["instrument", "note_ids"]

logger = logging.getLogger("ampscope")

_STATE = "_ampscope_instrumented"
"""Attribute on the accelerator that marks it instrumented (holds the Attacher)."""


_DEEPSPEED = "_ampscope_deepspeed"
"""Attribute on a DeepSpeed accelerator that holds the monitor of its engine."""

_WATCHED_PRECISIONS = ("bf16", "no")
"""Accelerate's mixed precisions that train without a loss scaler and get a watch."""


def instrument(
    accelerator: Accelerator,
    *,
    track_origin: bool | None = None,
    policy: Policy = "observe",
    max_consecutive_skips: int | None = None,
    **scaler_options: Any,
) -> TelemetryFrontEnd | None:
    """Put ampscope's scaler wherever ``accelerator`` holds its loss scaler, or a
    ``GradWatch`` there when it trains in bf16 or fp32 without one.

    Call it before or after ``accelerator.prepare()``. Before: models prepared later are
    attached as ``prepare()`` returns them (wrapped in DDP or FSDP), with origin
    tracking when the run is distributed. After: the models Accelerate remembers are
    attached; for DDP that is the unwrapped module, so parameters get their names but
    origin tracking (which needs the DDP wrapper) is off and says so once. Calling it
    again returns the same scaler and changes nothing.

    Costs one scaler construction and one walk over each model's parameters.

    Args:
        accelerator: An ``accelerate.Accelerator``.
        track_origin: ``None`` (default): on when the process group has more than one
            rank. ``False`` turns it off, ``True`` asks for it on a single process too
            (which logs why it cannot apply).
        policy: The watch's policy when ``mixed_precision`` is ``"bf16"`` or ``"no"``:
            ``"observe"`` (default), ``"skip"`` (every rank skips an iteration with
            inf/NaN gradients; ``optimizer.step_was_skipped`` holds the scheduler) or
            ``"raise"``. Ignored when Accelerate has a loss scaler, which always skips.
        max_consecutive_skips: The watch's limit under ``skip`` (see
            :class:`ampscope.GradWatch`).
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler`
            (``run_id``, ``reporter``, ``sinks``, ``top_k``...). The scaling itself
            (initial scale, factors, interval) stays Accelerate's.

    Returns:
        The ampscope scaler or watch (also ``accelerator.scaler``); on DeepSpeed
        (``distributed_type == DEEPSPEED``) a
        :class:`~ampscope.integrations.deepspeed.DeepSpeedMonitor` that observes the
        engine ``prepare()`` builds (DeepSpeed scales and skips inside it; no scaler is
        swapped); or ``None`` when Accelerate has neither a loss scaler nor a precision a
        watch applies to (fp16 refused on CPU, fp8): then nothing is changed and a warning
        says so once.
    """
    check_options(scaler_options)
    watch = check_policy(policy, max_consecutive_skips)
    return instrument_accelerator(accelerator, track_origin, scaler_options, "Accelerate", watch)


def instrument_accelerator(
    accelerator: Accelerator,
    track_origin: bool | None,
    scaler_options: dict[str, Any],
    library: str,
    watch: WatchConfig,
) -> TelemetryFrontEnd | None:
    """:func:`instrument` for an accelerator of ``library`` (Accelerate or a Trainer)."""
    if attacher_of(accelerator) is not None:
        return _live(accelerator)
    attacher = Attacher(track_origin)
    setattr(accelerator, _STATE, attacher)
    if _on_deepspeed(accelerator):
        return _observe_deepspeed(accelerator, attacher, scaler_options, library)
    ours: TelemetryFrontEnd | None = twin(accelerator.scaler, scaler_options)
    if ours is None and _watchable(accelerator):
        why = f"mixed_precision={accelerator.mixed_precision!r}"
        logger.info(WATCHING.format(library=library, why=why, policy=watch.policy))
        ours = make_watch(watch, scaler_options)
    if ours is None:
        why = (
            f"mixed_precision={accelerator.mixed_precision!r} on {accelerator.device.type}, "
            f"{accelerator.distributed_type}"
            if accelerator.scaler is None
            else f"its scaler is a {type(accelerator.scaler).__qualname__}"
        )
        logger.warning(NO_SCALER.format(library=library, why=why, cpu_fallback="fp32"))
        return None
    swap_into(accelerator, ours)
    _clip_through(accelerator)
    for model in accelerator._models:
        if not isinstance(model, nn.Module):
            continue
        hidden = is_distributed() and not _is_wrapped(model)
        if hidden and track_origin is not False:
            logger.warning(
                "ampscope: instrument() ran after accelerator.prepare(), which keeps only the "
                "unwrapped %s; parameters are named, but origin tracking needs instrument() "
                "before prepare()",
                type(model).__name__,
            )
        attacher.attach(ours, model, names_only=hidden)
    _attach_on_prepare(accelerator)
    return ours


def _clip_through(accelerator: Accelerator) -> None:
    """Route ``accelerator.clip_grad_norm_`` (the ``Trainer`` calls it with
    ``max_grad_norm``, 1.0 by default) through the front-end's ``clip_grad_norm_``: the
    same clip as Accelerate's, bit for bit, whose one pass also gives the records' gradient
    norms, so ampscope runs no norm pass of its own. Where Accelerate clips otherwise
    (FSDP's own clip, DeepSpeed, XLA, DTensor gradients, whose norms it combines per mesh)
    its own method runs unchanged. An instance attribute shadows the method for this
    accelerator only; it clips through whichever front-end ``accelerator.scaler`` holds
    (:func:`renew` may have put a new one there)."""
    from accelerate.utils import DistributedType

    from ampscope.rank.frontends.watch import GradWatch

    original = accelerator.clip_grad_norm_
    own_clip = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA)
    plans: dict[tuple[int, ...], _ClipPlan] = {}

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        front = accelerator.scaler
        if (
            # A micro-batch of an accumulation (bf16/fp32 loops may clip on every one):
            # the gradients are not whole yet, and no update() follows to end a check.
            not accelerator.sync_gradients
            or accelerator.distributed_type in own_clip
            or not isinstance(front, TelemetryFrontEnd)
        ):
            return original(params, max_norm, norm_type)
        plan = _clip_plan(plans, params, accelerator._optimizers)
        if plan.dtensors:
            return original(params, max_norm, norm_type)
        accelerator.unscale_gradients()  # fp16: the scaler's unscale_, as Accelerate's
        if isinstance(front, GradWatch):
            # No scaler, nothing to unscale: the watch checks before the clip instead of
            # at step(), so that the clip's pass gives the norms; only the optimizers of
            # the clipped parameters (another's backward may not have run yet).
            for inner in plan.owners:
                if not front.checked(inner):
                    front.unscale_(inner)
        return front.clip_grad_norm_(params, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


class _ClipPlan(NamedTuple):
    """What a clip over one parameter list needs to know, decided once per list."""

    dtensors: bool
    """Some parameter is a DTensor (FSDP2, tensor parallelism; so are its gradients):
    Accelerate combines their norms per mesh, its own clip runs."""
    owners: list[Any]
    """The (unwrapped) optimizers that hold some of the parameters."""


_PLAN_KEYS = 8
"""Distinct clipped parameter lists remembered (a loop clips one, or one per optimizer)."""


def _clip_plan(
    cache: dict[tuple[int, ...], _ClipPlan], params: list[Any], optimizers: list[Any]
) -> _ClipPlan:
    """The plan of a clip over ``params`` with these ``optimizers``: the parameters are
    walked once per list; a repeated clip costs a tuple of ids and a lookup."""
    from ampscope.rank import compat

    key = (*map(id, optimizers), -1, *map(id, params))
    plan = cache.get(key)
    if plan is None:
        ids = set(map(id, params))
        inners = [getattr(o, "optimizer", o) for o in optimizers]
        plan = _ClipPlan(
            dtensors=any(compat.is_dtensor(p) for p in params),
            owners=[
                inner
                for inner in inners
                if any(id(p) in ids for group in inner.param_groups for p in group["params"])
            ],
        )
        if len(cache) >= _PLAN_KEYS:
            cache.clear()
        cache[key] = plan
    return plan


def _on_deepspeed(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _observe_deepspeed(
    accelerator: Accelerator,
    attacher: Attacher,
    scaler_options: dict[str, Any],
    library: str,
) -> TelemetryFrontEnd:
    """DeepSpeed scales, checks and skips inside its engine, where no scaler swap reaches:
    a :class:`~ampscope.integrations.deepspeed.DeepSpeedMonitor` observes the engine that
    ``prepare()`` builds (or built already), as ``instrument(engine)`` would."""
    from ampscope.integrations.deepspeed import make_monitor

    monitor = make_monitor(attacher.track_origin, scaler_options)
    setattr(accelerator, _DEEPSPEED, monitor)
    logger.info("ampscope: %s trains with DeepSpeed; ampscope observes its engine", library)
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        attacher.attach(monitor, wrapped.engine)
    _attach_on_prepare(accelerator)
    return monitor


def attacher_of(accelerator: Accelerator) -> Attacher | None:
    """The Attacher of an instrumented accelerator, ``None`` if not instrumented."""
    attacher: Attacher | None = getattr(accelerator, _STATE, None)
    return attacher


def _watchable(accelerator: Accelerator) -> bool:
    """No loss scaler, bf16 or fp32, and Accelerate's own optimizer step (not DeepSpeed's
    engine, which steps and checks inside itself)."""
    from accelerate.utils import DistributedType

    return (
        accelerator.scaler is None
        and accelerator.mixed_precision in _WATCHED_PRECISIONS
        and accelerator.distributed_type != DistributedType.DEEPSPEED
    )


def swap_into(accelerator: Accelerator, scaler: TelemetryFrontEnd) -> None:
    """Replace ``accelerator.scaler`` and every prepared optimizer's scaler.

    A watch also goes to optimizers prepared without a scaler (bf16, fp32), set up as
    ``AcceleratedOptimizer.__init__`` sets up one built with a scaler.
    """
    from ampscope.rank.frontends.watch import GradWatch

    accelerator.scaler = scaler
    for optimizer in accelerator._optimizers:
        if getattr(optimizer, "scaler", None) is not None:
            optimizer.scaler = scaler
        elif isinstance(scaler, GradWatch):
            give_scaler(optimizer, scaler)
        # Otherwise an AcceleratedOptimizer built without a scaler steps without one.


def give_scaler(optimizer: Any, scaler: TelemetryFrontEnd) -> None:
    """Make an ``AcceleratedOptimizer`` built without a scaler step through ``scaler``:
    the attributes its constructor sets when given one (accelerate/optimizer.py), with
    Accelerate's own ``patch_optimizer_step`` telling whether the inner step ran."""
    from accelerate.optimizer import patch_optimizer_step

    optimizer.scaler = scaler
    optimizer._accelerate_step_called = False
    optimizer._optimizer_original_step_method = optimizer.optimizer.step
    optimizer._optimizer_patched_step_method = patch_optimizer_step(
        optimizer, optimizer.optimizer.step
    )


def _is_wrapped(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    return isinstance(model, (DDP, FSDP, FSDPModule))


def _attach_on_prepare(accelerator: Accelerator) -> None:
    """Wrap this accelerator's ``prepare``/``prepare_model`` to attach what they return.

    Accelerate has no hook for "a model was prepared"; an instance attribute shadows the
    method for this accelerator only, and calls it unchanged. It attaches the front-end
    the accelerator holds when it returns (:func:`renew` may have put a new one there).
    """
    for name in ("prepare", "prepare_model"):
        setattr(accelerator, name, _attaching(getattr(accelerator, name), accelerator))


def _live(accelerator: Accelerator) -> TelemetryFrontEnd | None:
    """The front-end an instrumented accelerator holds now: the DeepSpeed monitor, or the
    scaler or watch in ``accelerator.scaler``."""
    current = getattr(accelerator, _DEEPSPEED, None) or accelerator.scaler
    return current if isinstance(current, TelemetryFrontEnd) else None


def _attaching(original: Callable[..., Any], accelerator: Accelerator) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepared(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if kwargs.get("evaluation_mode"):
            return result  # prepared for inference only: no gradients to watch
        scaler, attacher = _live(accelerator), attacher_of(accelerator)
        if scaler is None or attacher is None:
            return result
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, nn.Module):
                attacher.attach(scaler, obj)
            else:
                _hand_live_scaler(obj, scaler)
        return result

    return prepared


def _hand_live_scaler(obj: Any, scaler: TelemetryFrontEnd) -> None:
    """An optimizer prepared again (``prepare`` hands an ``AcceleratedOptimizer`` back as it
    is) that still steps through a closed front-end of this accelerator's gets the live one:
    after ``free_memory()`` the accelerator no longer lists it, so :func:`renew`'s swap missed
    it, and a step through the old scaler after a backward through the new one fails
    (``unscale_()`` already called) or records nothing."""
    held = getattr(obj, "scaler", None)
    if isinstance(held, TelemetryFrontEnd) and held is not scaler and held.telemetry.closed:
        obj.scaler = scaler


def renew(
    accelerator: Accelerator, watch: WatchConfig, scaler_options: dict[str, Any]
) -> TelemetryFrontEnd | None:
    """A new front-end in place of the instrumented accelerator's closed one, for a new
    run of training (the Trainer's ``train()`` again, after the last one ended or raised):
    the twin of the closed scaler (its scaling state too) or a new watch, swapped in
    wherever the old one was; it is attached to the models the next ``prepare()`` returns
    (the Trainer's ``on_train_begin`` attaches ``model_wrapped`` too). Its records make the
    rank running again on the exporter (a new process's records, as a restart's). Costs a
    scaler construction.

    Returns:
        The new front-end; ``None`` when there is nothing to renew (the front-end is open,
        the accelerator is not instrumented, or a DeepSpeed monitor, one per engine).
    """
    from ampscope.rank.frontends.watch import GradWatch

    attacher = attacher_of(accelerator)
    closed = accelerator.scaler
    if (
        attacher is None
        or getattr(accelerator, _DEEPSPEED, None) is not None
        or not isinstance(closed, TelemetryFrontEnd)
        or not closed.telemetry.closed
    ):
        return None
    fresh: TelemetryFrontEnd | None = (
        make_watch(watch, scaler_options)
        if isinstance(closed, GradWatch)
        else twin(closed, scaler_options)
    )
    if fresh is None:
        return None
    warn_if_sinks_reused(scaler_options, "Accelerate's accelerator")
    swap_into(accelerator, fresh)
    # A new attacher: the models the closed front-end was attached to are attached anew,
    # when the next prepare() returns them or the Trainer begins training.
    setattr(accelerator, _STATE, Attacher(attacher.track_origin))
    return fresh
