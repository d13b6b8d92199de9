"""The rank side: everything that runs inside a training process.

The front-ends a loop calls are torch's ``GradScaler``/``ShardedGradScaler`` plus telemetry
(fp16), and :class:`GradWatch` for bf16/fp32 runs; ``capture/``, ``gradients/`` and
``telemetry/`` hold what they share, ``fp8/`` observes an attached model's torchao
``Float8Linear`` layers, ``compat.py`` every read of torch internals.

Change one import and keep the training loop::

    from ampscope import GradScaler           # torch.amp.GradScaler: FSDP2, DDP, single
    from ampscope import ShardedGradScaler    # FSDP1 FullyShardedDataParallel

    scaler = GradScaler("cuda", run_id="exp-42")
    scaler.attach(model)                      # parameter names in overflow records
    for batch in loader:
        scaler.scale(loss_fn(model(batch))).backward()
        scaler.step(optimizer)
        scaler.update()
        if not scaler.last_step_skipped:
            lr_scheduler.step()
    print(scaler.telemetry.snapshot())

Every update() produces one :class:`~ampscope.reporter.schema.StepRecord`, built on a
background thread and sent to the reporter and sinks.

bf16 and fp32 runs have no scaler: :class:`GradWatch` speaks the same protocol, finds
inf/NaN gradients and observes, skips or stops (:class:`NonFiniteGradientsError`).
"""

from ampscope.rank.config import TelemetryConfig
from ampscope.rank.frontends.scalers import GradScaler, ShardedGradScaler
from ampscope.rank.frontends.stop import NonFiniteGradientsError
from ampscope.rank.frontends.watch import GradWatch
from ampscope.rank.telemetry.pipeline import Telemetry, TelemetrySnapshot

__all__ = [
    "GradScaler",
    "GradWatch",
    "NonFiniteGradientsError",
    "ShardedGradScaler",
    "Telemetry",
    "TelemetryConfig",
    "TelemetrySnapshot",
]
