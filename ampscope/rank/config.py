"""The scalers' and the watch's options, validated once at construction.

The telemetry options are defined once, as :class:`TelemetryConfig`'s fields. The
front-ends take them as keyword arguments (``**telemetry``), typed for checkers and IDEs
by :class:`ScalerOptions` and :class:`WatchOptions`, and turn them into a config with
:func:`telemetry_config`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict

from ampscope.reporter.fault_rule import FaultRule
from ampscope.reporter.schema import MAX_LABEL_LENGTH, MAX_NONFINITE_PARAMS, Policy
from ampscope.reporter.sinks import Sink
from ampscope.reporter.spike_rule import SpikeRule

LABEL_CHARS = "A-Za-z0-9_.:/@+=-"
"""The characters of the schema's labels (run ids, node names, devices), as a regex
character set's contents."""
LABEL_PATTERN = re.compile(rf"^[{LABEL_CHARS}]+$")
"""The schema's label pattern, the rank side's one copy."""


DEFAULT_FP8_EVERY = 25
"""Observe FP8 layers on one iteration in this many. ``python -m bench.fp8`` (12 emulated
``Float8Linear`` layers on the CPU) measured an observed iteration at about x1.27 the step
time: one in 25 spreads that to about 1 %, under the 2 % budget with the watch's own cost
(docs/fp8.md)."""


DEFAULT_REPLICA_CHECK_EVERY = 100
"""Compare the parameters with their replicas on one iteration in this many.
``python -m bench.replicas`` (two gloo ranks, the GPT-shaped CPU bench model of 148
tensors) measured a check at about 1.3 ms against a 70 ms step (1.9 %), and a step with a
check on every iteration at x1.32 of one without (the all-gather also waits for the slower
rank): one in 100 keeps either under 0.5 % (docs/silent-corruption.md#costs)."""


def check_replica_check_every(value: object) -> int:
    """``value`` when it is an int of at least 0 (0: no check), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"replica_check_every must be an int >= 0, not {value!r}")
    return value


def check_fp8_every(value: object) -> int:
    """``value`` when it is a positive int, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"fp8_every must be a positive int, not {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    """Telemetry options of :class:`ampscope.GradScaler`, :class:`ampscope.ShardedGradScaler`
    and :class:`ampscope.GradWatch` (which has no scale to clamp: no ``min_scale`` or
    ``max_scale``).

    They take these as keyword-only constructor arguments of the same names.
    """

    reporter: Sink | Literal["auto"] | None = "auto"
    """``"auto"``: an ``HttpReporter`` to ``AMPSCOPE_URL`` (default the local exporter);
    ``AMPSCOPE_URL=off`` disables it. ``None``: no reporter. Or any :class:`Sink`."""
    sigterm_handler: bool = True
    """With ``reporter="auto"``: install the process's SIGTERM handler (from the main thread,
    once per process), so that a rank its launcher stops (torchrun's elastic restart, a
    Slurm preemption, a Kubernetes eviction) sends its final heartbeat and reads
    ``stopped``, not ``lost``; a handler installed before it still runs after it, and the
    process still ends by the signal. ``False``, or ``AMPSCOPE_SIGTERM_HANDLER=off``: no
    handler (docs/exporter.md#stopped-ranks)."""
    sinks: Sequence[Sink] = field(default=())
    """Further destinations for every record, called after the reporter, in step order."""
    run_id: str | None = None
    """Overrides ``AMPSCOPE_RUN_ID``/``TORCHELASTIC_RUN_ID``; must be the same on every rank."""
    attribution: bool = True
    """Name the parameters holding non-finite gradients on overflow iterations."""
    top_k: int = 8
    """How many parameters a record (and the cumulative totals) name at most."""
    history: int = 1024
    """Length of the in-process ring buffer behind ``scaler.telemetry.history()``."""
    min_scale: float | None = None
    """Clamp the scale from below after each automatic update(); ``None``: torch's behaviour."""
    max_scale: float | None = None
    """Clamp the scale from above after each automatic update(); ``None``: torch's behaviour."""
    stats: bool = True
    """Record each iteration's loss, gradient norm and (origin tracking) this rank's own
    gradient norm, and name the top-K parameters by gradient norm on the rank's spike
    iterations (``StepRecord.stats``). ``False``: no norm pass, records carry ``None``."""
    spike_rule: SpikeRule | None = None
    """The rank's own spike rule for its loss and gradient norm; ``None``: the default
    :class:`~ampscope.reporter.spike_rule.SpikeRule` (the exporter's)."""
    fault_rule: FaultRule | None = None
    """When a scaler's overflow is a fault rather than its weather (how many clean
    iterations make a scale clean); ``None``: the default
    :class:`~ampscope.reporter.fault_rule.FaultRule` (docs/scalers.md#faults-and-weather)."""
    fp8_every: int = DEFAULT_FP8_EVERY
    """Observe the ``Float8Linear`` layers of an attached model (torchao) on the first
    iteration and then one in ``fp8_every`` (``attach(model, fp8_every=...)`` overrides
    it). Each observed iteration costs three reductions and three elementwise passes over
    each cast tensor, on its device (docs/fp8.md#costs)."""
    replica_check_every: int = DEFAULT_REPLICA_CHECK_EVERY
    """Compare the attached model's parameters, bit for bit, with the ranks that must hold
    the same values (DDP, HSDP, FSDP1 ``HYBRID_SHARD``, DeepSpeed ZeRO 0-2) after the
    optimizer step, on one iteration in this many; 0: never (``attach(model,
    replica_check_every=...)`` overrides it). A check costs two kernels per 2**24
    parameter elements, one small all-gather and one host read
    (docs/silent-corruption.md)."""

    def __post_init__(self) -> None:
        if not (
            self.reporter is None or self.reporter == "auto" or isinstance(self.reporter, Sink)
        ):
            raise TypeError(f"reporter must be 'auto', None or a Sink, not {self.reporter!r}")
        if not isinstance(self.sigterm_handler, bool):
            raise TypeError(f"sigterm_handler must be a bool, not {self.sigterm_handler!r}")
        if isinstance(self.sinks, (str, bytes)) or not isinstance(self.sinks, Sequence):
            raise TypeError("sinks must be a sequence of Sink objects")
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"{sink!r} does not implement emit(record) and close(timeout)")
        object.__setattr__(self, "sinks", tuple(self.sinks))
        if self.run_id is not None and (
            len(self.run_id) > MAX_LABEL_LENGTH or not LABEL_PATTERN.match(self.run_id)
        ):
            raise ValueError(
                f"run_id {self.run_id!r} must be 1-{MAX_LABEL_LENGTH} characters of "
                "letters, digits and _.:/@+=-"
            )
        if not 1 <= self.top_k <= MAX_NONFINITE_PARAMS:
            raise ValueError(
                f"top_k must be between 1 and {MAX_NONFINITE_PARAMS}, not {self.top_k}"
            )
        if self.spike_rule is not None and not isinstance(self.spike_rule, SpikeRule):
            raise TypeError(f"spike_rule must be a SpikeRule, not {self.spike_rule!r}")
        if self.fault_rule is not None and not isinstance(self.fault_rule, FaultRule):
            raise TypeError(f"fault_rule must be a FaultRule, not {self.fault_rule!r}")
        check_fp8_every(self.fp8_every)
        check_replica_check_every(self.replica_check_every)
        if self.history < 1:
            raise ValueError(f"history must be at least 1, not {self.history}")
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, not {value}")
        if (
            self.min_scale is not None
            and self.max_scale is not None
            and self.min_scale > self.max_scale
        ):
            raise ValueError(f"min_scale {self.min_scale} exceeds max_scale {self.max_scale}")


SCALE_CLAMPS = ("min_scale", "max_scale")
"""The options that clamp a scale: a watch has none to clamp, so it takes neither."""

_SCALER_OPTIONS = frozenset(f.name for f in fields(TelemetryConfig))
_WATCH_OPTIONS = _SCALER_OPTIONS.difference(SCALE_CLAMPS)


class WatchOptions(TypedDict, total=False):
    """The telemetry keyword arguments of :class:`ampscope.GradWatch`: the fields of
    :class:`TelemetryConfig` but :data:`SCALE_CLAMPS` (a type for checkers and IDEs; the
    config holds the defaults, the checks and the documentation)."""

    reporter: Sink | Literal["auto"] | None
    sigterm_handler: bool
    sinks: Sequence[Sink]
    run_id: str | None
    attribution: bool
    top_k: int
    history: int
    stats: bool
    spike_rule: SpikeRule | None
    fault_rule: FaultRule | None
    fp8_every: int
    replica_check_every: int


class ScalerOptions(WatchOptions, total=False):
    """The telemetry keyword arguments of :class:`ampscope.GradScaler` and
    :class:`ampscope.ShardedGradScaler`: every field of :class:`TelemetryConfig`."""

    min_scale: float | None
    max_scale: float | None


def telemetry_config(owner: str, options: Mapping[str, Any], *, scale: bool) -> TelemetryConfig:
    """The validated telemetry config of a front-end's keyword arguments.

    Args:
        owner: The callable that took them, as Python names it in a ``TypeError``
            (``"GradWatch.__init__"``).
        options: The keyword arguments.
        scale: The front-end has a scale to clamp (a scaler): it takes ``SCALE_CLAMPS``.

    Raises:
        TypeError: a keyword ``owner`` does not take (worded as Python words it), or a
            value of the wrong type.
        ValueError: a bad value.
    """
    allowed = _SCALER_OPTIONS if scale else _WATCH_OPTIONS
    for name in options:
        if name not in allowed:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
    return TelemetryConfig(**options)


POLICIES = ("observe", "skip", "raise")


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """What :class:`ampscope.GradWatch` does with an iteration whose gradients hold inf/NaN.

    The watch takes these as keyword arguments of the same names.
    """

    policy: Policy = "observe"
    """``observe``: record it, change nothing (no sync, no collective); ``skip``: every
    rank skips ``optimizer.step()``; ``raise``: every rank raises
    :class:`~ampscope.NonFiniteGradientsError` from ``step()``."""
    max_consecutive_skips: int | None = None
    """Under ``skip``: raise from the ``step()`` of the N-th consecutive skipped
    iteration (whose step is not taken) instead of skipping for ever."""
    process_group: Any = None
    """The group whose ranks agree on skipping or raising (``skip``, ``raise``): the
    gradients' data-parallel group. ``None``: the default (world) group."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        limit = self.max_consecutive_skips
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_consecutive_skips must be a positive int, not {limit!r}")
            if self.policy != "skip":
                raise ValueError(
                    f"max_consecutive_skips applies to policy 'skip', not {self.policy!r}"
                )
