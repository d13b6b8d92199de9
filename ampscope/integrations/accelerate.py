"""Hugging Face Accelerate: ``instrument(accelerator)`` swaps in ampscope's scaler.

Accelerate keeps its scaler in ``accelerator.scaler`` and hands it to every optimizer
wrapper (``AcceleratedOptimizer.scaler``) in ``prepare()``; its own ``backward()``,
``clip_grad_norm_()`` and ``unscale_gradients()`` read ``accelerator.scaler``. The swap
replaces it in all of those places, with the same class Accelerate chose
(``torch.amp.GradScaler`` for DDP, FSDP2 and one device, ``ShardedGradScaler`` for FSDP1).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ampscope.integrations._swap import NO_SCALER, Attacher, check_options, is_distributed, twin
from ampscope.scaler.mixin import TelemetryMixin

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger("ampscope")

_STATE = "_ampscope_instrumented"
"""Attribute on the accelerator that marks it instrumented (holds the Attacher)."""


def instrument(
    accelerator: Accelerator, *, track_origin: bool | None = None, **scaler_options: Any
) -> TelemetryMixin | None:
    """Put ampscope's scaler wherever ``accelerator`` holds its loss scaler.

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
        **scaler_options: Telemetry options of :class:`ampscope.GradScaler`
            (``run_id``, ``reporter``, ``sinks``, ``top_k``...). The scaling itself
            (initial scale, factors, interval) stays Accelerate's.

    Returns:
        The ampscope scaler (also ``accelerator.scaler``), or ``None`` when Accelerate
        uses no loss scaler (bf16, fp32, fp16 refused on CPU, DeepSpeed): then nothing
        is changed and a warning says so once.
    """
    check_options(scaler_options)
    return instrument_accelerator(accelerator, track_origin, scaler_options, "Accelerate")


def instrument_accelerator(
    accelerator: Accelerator,
    track_origin: bool | None,
    scaler_options: dict[str, Any],
    library: str,
) -> TelemetryMixin | None:
    """:func:`instrument` for an accelerator of ``library`` (Accelerate or a Trainer)."""
    if attacher_of(accelerator) is not None:
        current = accelerator.scaler
        return current if isinstance(current, TelemetryMixin) else None
    attacher = Attacher(track_origin)
    setattr(accelerator, _STATE, attacher)
    ours = twin(accelerator.scaler, scaler_options)
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
    _attach_on_prepare(accelerator, ours, attacher)
    return ours


def attacher_of(accelerator: Accelerator) -> Attacher | None:
    """The Attacher of an instrumented accelerator, ``None`` if not instrumented."""
    attacher: Attacher | None = getattr(accelerator, _STATE, None)
    return attacher


def swap_into(accelerator: Accelerator, scaler: TelemetryMixin) -> None:
    """Replace ``accelerator.scaler`` and every prepared optimizer's scaler."""
    accelerator.scaler = scaler
    for optimizer in accelerator._optimizers:
        # AcceleratedOptimizer built without a scaler steps without one; leave it so.
        if getattr(optimizer, "scaler", None) is not None:
            optimizer.scaler = scaler


def _is_wrapped(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    return isinstance(model, (DDP, FSDP, FSDPModule))


def _attach_on_prepare(
    accelerator: Accelerator, scaler: TelemetryMixin, attacher: Attacher
) -> None:
    """Wrap this accelerator's ``prepare``/``prepare_model`` to attach what they return.

    Accelerate has no hook for "a model was prepared"; an instance attribute shadows the
    method for this accelerator only, and calls it unchanged.
    """
    for name in ("prepare", "prepare_model"):
        setattr(accelerator, name, _attaching(getattr(accelerator, name), scaler, attacher))


def _attaching(
    original: Callable[..., Any], scaler: TelemetryMixin, attacher: Attacher
) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepared(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if kwargs.get("evaluation_mode"):
            return result  # prepared for inference only: no gradients to watch
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, nn.Module):
                attacher.attach(scaler, obj)
        return result

    return prepared
