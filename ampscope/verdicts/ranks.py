"""What the rules know of a rank: its states, whether it runs a loss scaler, and ``RankFacts``.

One definition each, read by the exporter (its lifecycle, collector, JSON API and health)
and by ``ampscope status`` (over exporters' JSON or Prometheus series) alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

RankStateName = Literal["running", "stalled", "lost", "finished", "failed", "stopped"]
"""A rank's lifecycle state (``ampscope.exporter.state.lifecycle`` decides which)."""

STATES: tuple[RankStateName, ...] = get_args(RankStateName)
"""Every state, in the order /metrics, the API's counts and the tables list them: a new
state is one entry in ``RankStateName``."""

LIVE_STATES: tuple[RankStateName, ...] = ("running", "stalled")
"""States of a rank still heard from and still expected to step."""

ENDED_STATES: tuple[RankStateName, ...] = ("finished", "failed", "stopped", "lost")
"""States of a rank that no longer steps, as ``stalled_rank``'s summary counts them."""

FINAL_STATES: tuple[RankStateName, ...] = ("finished", "failed", "stopped")
"""States of a rank that sent its final record (said goodbye): normally, on an exception,
or because its launcher stopped it with a signal (SIGTERM: torchrun's elastic restart, a
Slurm preemption, a Kubernetes eviction). A run whose ranks are all in them ended; a rank
in them is never lost."""


def state_counts(states: Iterable[str]) -> dict[str, int]:
    """Ranks per state, every state listed (0 when none), in ``STATES``' order."""
    held = list(states)
    return {name: held.count(name) for name in STATES}


def reported_state(state: object, up: object) -> str:
    """A rank's state as an exporter's JSON gives it (``RankView.state``), for the rules and
    the tables alike.

    Exporters that predate the states say only whether the rank is ``up`` (heard within the
    stale TTL): such a rank reads ``running``, any other ``lost`` (silent, no final record
    known), which is what ``lost_rank`` counts. A state this version does not know (a newer
    exporter's) is kept as given: no rule counts it, the tables show it.
    """
    if isinstance(state, str) and state:
        return state
    return "running" if up else "lost"


def is_scaler(mode: str | None) -> bool:
    """Whether a rank of this ``Setup.mode`` runs a loss scaler (fp16). A watch (bf16/fp32)
    records scale 1, which is no scale, so the scale rules leave it out. ``None``: the
    rank's reporter or exporter predates the field, and only scalers reported then."""
    return mode in (None, "scaler")


def mode_of(view: Mapping[str, Any]) -> str | None:
    """``Setup.mode`` of a rank from the JSON API (``RankView``), ``None`` when absent."""
    setup = view.get("setup")
    return setup.get("mode") if isinstance(setup, Mapping) else None


@dataclass(frozen=True, kw_only=True)
class RankPaused:
    """A live rank that says it stops stepping on purpose (``paused()`` on the rank side):
    a fact beside its state, which stays ``running`` up to ``pause_limit_s``."""

    reason: str
    """What it does meanwhile (``checkpoint``, ``eval``...)."""
    seconds: float
    """How long it has been paused."""

    def text(self) -> str:
        """``paused (checkpoint) for 700 s``: how verdicts and tables say it."""
        return f"paused ({self.reason}) for {self.seconds:.0f} s"


def paused_of(view: Mapping[str, Any]) -> RankPaused | None:
    """A rank's pause from the JSON API (``RankView.pause``); ``None`` when absent (none, or
    an exporter that predates pauses) or malformed."""
    pause = view.get("pause")
    if not isinstance(pause, Mapping):
        return None
    reason, seconds = pause.get("reason"), pause.get("seconds")
    if not isinstance(reason, str) or not isinstance(seconds, int | float):
        return None
    return RankPaused(reason=reason, seconds=float(seconds))


@dataclass(frozen=True, kw_only=True)
class RankRef:
    """Which rank a rule's facts are about: every rule's facts start with it."""

    rank: int
    """The global rank."""
    node: str

    def ref(self) -> dict[str, Any]:
        """``{"rank": ..., "node": ...}``: how a verdict's evidence names the rank."""
        return {"rank": self.rank, "node": self.node}


@dataclass(frozen=True, kw_only=True)
class RankFacts(RankRef):
    """What the liveness and coverage rules read of one rank."""

    state: str
    """One of ``STATES``, or a newer exporter's state that no rule counts."""
    world_size: int
    """The world size the rank declared."""
    local_world_size: int | None
    """Ranks on its node, when the rank said (torchrun's ``LOCAL_WORLD_SIZE``)."""
    last_step: int
    last_report_time: float
    """When it was last heard from (the exporter's clock)."""
    seconds_since_report: float
    step_time: float | None = None
    """The rank's own clock at its last step, where the source holds it (not Prometheus)."""
    seconds_since_progress: float | None = None
    """Since its step last advanced, where the source holds it (the exporter's store)."""
    pause: RankPaused | None = None
    """The pause a live rank says (an exporter's store or JSON, or Prometheus'
    ``ampscope_rank_pause_start_timestamp_seconds``); ``None``: not paused."""
