"""``ampscope.GradScaler`` and ``ampscope.ShardedGradScaler``: torch's scalers plus telemetry.

Each takes exactly torch's constructor arguments (same order and defaults) plus the
keyword-only options of :class:`~ampscope.rank.config.TelemetryConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedGradScaler

from ampscope.rank.config import DEFAULT_FP8_EVERY, TelemetryConfig
from ampscope.rank.frontends.scaler_mixin import TelemetryMixin
from ampscope.reporter.sinks import Sink
from ampscope.reporter.spike_rule import SpikeRule


class GradScaler(TelemetryMixin, torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with telemetry: FSDP2 ``fully_shard``, DDP, single device.

    Training numerics are torch's, bit for bit. See ``torch.amp.GradScaler`` for the
    scaling arguments and :class:`~ampscope.rank.config.TelemetryConfig` for the
    keyword-only telemetry options.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        reporter: Sink | Literal["auto"] | None = "auto",
        sinks: Sequence[Sink] = (),
        run_id: str | None = None,
        attribution: bool = True,
        top_k: int = 8,
        history: int = 1024,
        min_scale: float | None = None,
        max_scale: float | None = None,
        stats: bool = True,
        spike_rule: SpikeRule | None = None,
        fp8_every: int = DEFAULT_FP8_EVERY,
    ) -> None:
        config = TelemetryConfig(
            reporter=reporter,
            sinks=sinks,
            run_id=run_id,
            attribution=attribution,
            top_k=top_k,
            history=history,
            min_scale=min_scale,
            max_scale=max_scale,
            stats=stats,
            spike_rule=spike_rule,
            fp8_every=fp8_every,
        )
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._ampscope_init(config)


class ShardedGradScaler(TelemetryMixin, _TorchShardedGradScaler):
    """FSDP1's ``ShardedGradScaler`` with telemetry (``FullyShardedDataParallel``).

    Training numerics are torch's, bit for bit. See
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` for the scaling
    arguments (note its order: ``backoff_factor`` before ``growth_factor``) and
    :class:`~ampscope.rank.config.TelemetryConfig` for the telemetry options.
    """

    _ampscope_reduces_found_inf_in_place = True

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: ProcessGroup | None = dist.group.WORLD,
        *,
        reporter: Sink | Literal["auto"] | None = "auto",
        sinks: Sequence[Sink] = (),
        run_id: str | None = None,
        attribution: bool = True,
        top_k: int = 8,
        history: int = 1024,
        min_scale: float | None = None,
        max_scale: float | None = None,
        stats: bool = True,
        spike_rule: SpikeRule | None = None,
        fp8_every: int = DEFAULT_FP8_EVERY,
    ) -> None:
        config = TelemetryConfig(
            reporter=reporter,
            sinks=sinks,
            run_id=run_id,
            attribution=attribution,
            top_k=top_k,
            history=history,
            min_scale=min_scale,
            max_scale=max_scale,
            stats=stats,
            spike_rule=spike_rule,
            fp8_every=fp8_every,
        )
        super().__init__(
            device,
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            process_group=process_group,
        )
        self._ampscope_init(config)
