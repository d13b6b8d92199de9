"""What the three integrations share: build ampscope's twin of a library's scaler, attach.

An integration never chooses the numerics: the twin copies the stock scaler's class
(``torch.amp.GradScaler`` or FSDP1's ``ShardedGradScaler``), device, factors, interval,
process group and current state through torch's public API, so training continues exactly
as the library configured it. Torch's private state is read only through
:mod:`ampscope.rank.compat`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchSharded

from ampscope.rank import compat
from ampscope.rank.config import SCALE_CLAMPS, TelemetryConfig, WatchConfig
from ampscope.rank.frontends.base import TelemetryFrontEnd
from ampscope.rank.frontends.scaler_mixin import TelemetryMixin
from ampscope.rank.frontends.scalers import GradScaler, ShardedGradScaler
from ampscope.rank.frontends.watch import GradWatch
from ampscope.reporter.schema import Policy

logger = logging.getLogger("ampscope")

NO_SCALER = (
    "ampscope: {library} has no loss scaler to instrument ({why}); ampscope changes nothing. "
    "{library} scales the loss only for fp16 mixed precision on an accelerator (on CPU it "
    "turns fp16 into {cpu_fallback}; DeepSpeed scales inside its own engine)."
)
"""The one message an integration logs when there is nothing to swap or watch."""

WATCHING = (
    "ampscope: {library} trains without a loss scaler ({why}); a GradWatch (policy "
    "{policy!r}) checks its gradients for inf/NaN instead."
)
"""Logged once when an integration installs a watch where there is no scaler."""


def check_options(scaler_options: dict[str, Any]) -> None:
    """Validate the telemetry options now, where the user passed them.

    Raises:
        TypeError: an option that is not a :class:`TelemetryConfig` field (scaling
            arguments such as ``init_scale`` belong to the library's own configuration).
        ValueError: a bad value, as the scalers' constructors raise.
    """
    TelemetryConfig(**scaler_options)


def check_policy(policy: Policy, max_consecutive_skips: int | None = None) -> WatchConfig:
    """Validate a watch policy now, where the user passed it.

    Raises:
        ValueError: not ``observe``, ``skip`` or ``raise``, or a bad
            ``max_consecutive_skips`` (see :class:`WatchConfig`).
    """
    return WatchConfig(policy=policy, max_consecutive_skips=max_consecutive_skips)


def warn_if_sinks_reused(scaler_options: dict[str, Any], library: str) -> None:
    """Say, when a new front-end replaces a closed one (a retry of training in the process),
    that reporter or sink objects in the options were closed with it: a closed reporter
    drops the new front-end's records, so the rank keeps its last state on the exporter."""
    reporter = scaler_options.get("reporter", "auto")
    objects = list(scaler_options.get("sinks", ()))
    if reporter is not None and reporter != "auto":
        objects.insert(0, reporter)
    if objects:
        names = ", ".join(type(sink).__name__ for sink in objects)
        logger.warning(
            "ampscope: %s trains again with a new front-end, but the reporter or sinks "
            "passed in its options (%s) were closed with the last one and record nothing "
            "more; pass the exporter's URL (AMPSCOPE_URL) instead of a reporter object "
            "where training retries in its process",
            library,
            names,
        )


def make_watch(watch: WatchConfig, scaler_options: dict[str, Any]) -> GradWatch:
    """A :class:`GradWatch` with the user's telemetry options (scale clamps left out)."""
    options = {k: v for k, v in scaler_options.items() if k not in SCALE_CLAMPS}
    return GradWatch(watch.policy, max_consecutive_skips=watch.max_consecutive_skips, **options)


def twin(stock: Any, scaler_options: dict[str, Any]) -> TelemetryMixin | None:
    """ampscope's scaler in place of ``stock``, trained exactly like it.

    Returns ``stock`` itself when it already is ampscope's and open (so instrumenting
    twice changes nothing), ``None`` when ``stock`` is no torch scaler ampscope subclasses
    (then the caller leaves it alone). The twin takes over ``stock``'s state via
    ``state_dict()``, so a swap after training started keeps the scale and tracker; so
    does the twin of ampscope's scaler once closed (a new fit or ``train()`` after the
    last one ended or raised: a new front-end, the same scaling).
    """
    if isinstance(stock, TelemetryMixin) and not stock.telemetry.closed:
        return stock
    if not isinstance(stock, torch.amp.GradScaler):
        return None
    enabled = stock.is_enabled()
    arguments: dict[str, Any] = {"enabled": enabled}
    if enabled:
        # get_scale() is the initial scale until the first scale(): no device sync then.
        arguments.update(
            init_scale=stock.get_scale(),
            growth_factor=stock.get_growth_factor(),
            backoff_factor=stock.get_backoff_factor(),
            growth_interval=stock.get_growth_interval(),
        )
    device = compat.scaler_device(stock)
    ours: TelemetryMixin
    if isinstance(stock, _TorchSharded):
        # torch sets process_group only on an enabled ShardedGradScaler.
        group = getattr(stock, "process_group", dist.group.WORLD)
        ours = ShardedGradScaler(device, process_group=group, **arguments, **scaler_options)
    else:
        ours = GradScaler(device, **arguments, **scaler_options)
    if enabled:
        ours.load_state_dict(stock.state_dict())
    return ours


def is_distributed() -> bool:
    """Whether this process runs in a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Attacher:
    """Attaches a scaler to each model once, origin tracking where the run is distributed.

    Origin tracking that the model cannot support (no gradient collective, an unsupported
    wrapper, a comm hook of the user's) is logged once and skipped: an integration must
    never stop training for telemetry.
    """

    def __init__(self, track_origin: bool | None) -> None:
        self.track_origin = track_origin
        self._attached: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def attach(
        self, scaler: TelemetryFrontEnd, model: nn.Module, *, names_only: bool = False
    ) -> None:
        """Attach ``scaler`` to ``model`` unless done before; ``names_only`` skips origin."""
        if model in self._attached:  # nn.Module hashes by identity
            return
        self._attached.add(model)
        origin = is_distributed() if self.track_origin is None else self.track_origin
        if origin and not names_only:
            try:
                scaler.attach(model, track_origin=True)
                return
            except (TypeError, ValueError) as exc:
                logger.warning(
                    "ampscope: origin tracking is off for %s: %s", type(model).__name__, exc
                )
        scaler.attach(model)
