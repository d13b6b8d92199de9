"""DeepSpeed: ``instrument(engine)`` once after ``deepspeed.initialize``.

::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    monitor = ampscope.integrations.deepspeed.instrument(engine, run_id="exp-42")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

One record per rank and optimizer step, DeepSpeed's numerics unchanged. The rooms:

* :mod:`~ampscope.integrations.deepspeed.monitor`: the monitor (what each record says,
  where each value comes from, what it costs);
* :mod:`~ampscope.integrations.deepspeed.engine`: every read of DeepSpeed's state (with
  :mod:`~ampscope.integrations.deepspeed.reduction`, the only modules that know DeepSpeed
  0.19.8's attributes);
* :mod:`~ampscope.integrations.deepspeed.reduction`: where DeepSpeed reduces the gradients
  at each ZeRO stage, and the wraps of its methods there;
* :mod:`~ampscope.integrations.deepspeed.origin`: the checks of this rank's own gradients
  right before the reduction (at the boundary, per bucket, or a hook per parameter);
* :mod:`~ampscope.integrations.deepspeed.step_reads`: a step's device values on their way
  to the telemetry thread, never read on the training thread.
"""

from ampscope.integrations.deepspeed.monitor import (
    DeepSpeedMonitor,
    instrument,
    make_monitor,
    monitor_of,
)

__all__ = ["DeepSpeedMonitor", "instrument", "make_monitor", "monitor_of"]
