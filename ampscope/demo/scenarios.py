"""What goes wrong in each demo run, kept as data so the CLI can list it without torch.

Every scenario is a separate run (its own model, scaler and run id) trained side by side
on the same ranks. Steps are 1-based ``update()`` counts, as in the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One way for mixed-precision training to go wrong, and what ampscope should say."""

    name: str
    """Short id; also the last part of the run id."""
    story: str
    """One line for people: what happens in this run."""
    expect: tuple[str, ...]
    """Health rules of the exporter that should flag the run by the end."""
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    outlier_rank: int | None = None
    """Rank whose data holds outlier samples every ``outlier_every`` steps (``-1``: the last)."""
    outlier_every: int = 0
    outlier_batches: int | None = None
    """How many outlier batches (the first ones); ``None``: every ``outlier_every`` steps."""
    outlier_factor: float = 1.0
    """Outlier samples are this many times larger than the rest."""
    corrupt_from: float | None = None
    """From this fraction of the run on, every rank's inputs are ``corrupt_factor`` too
    large: the fp16 forward pass overflows whatever the loss scale."""
    corrupt_factor: float = 1e5
    stale_restore_at: float | None = None
    """At this fraction of the run, the last rank reloads the scaler state it saved after
    step 1, as a rank restarted from a stale checkpoint would."""
    bad_batch_at: float | None = None
    """At this fraction of the run, the last rank draws one bad batch: its inputs are
    ``bad_batch_factor`` times larger, its loss and its own gradients spike, and the step
    is not skipped as long as the scaled gradients stay finite in fp16."""
    bad_batch_factor: float = 1.0
    rerun: bool = False
    """Every rank hands ``step()`` a closure that recomputes the iteration from the same
    batch (``scaler.step(optimizer, rerun=closure)``): a flagged iteration is rerun on every
    rank and each compares its own two results."""
    nan_sample_at: float | None = None
    """At this fraction of the run, one sample of the last rank's batch holds NaN: bad data,
    which the rerun reproduces (``reproducible_fault``, naming the sample's id)."""
    transient_fault_at: float | None = None
    """At this fraction of the run, rank 0's own gradients turn inf on the first pass of the
    iteration only, as a one-time device fault would: the rerun is clean
    (``transient_fault``) and the step goes on with its gradients."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"{self.name}: init_scale must be positive and finite")
        if self.growth_interval < 1:
            raise ValueError(f"{self.name}: growth_interval must be at least 1")
        if self.outlier_rank is not None and self.outlier_every < 1:
            raise ValueError(f"{self.name}: outlier_every must be at least 1 with an outlier_rank")
        if self.bad_batch_at is not None and not (
            math.isfinite(self.bad_batch_factor) and self.bad_batch_factor > 1
        ):
            raise ValueError(f"{self.name}: bad_batch_factor must be finite and above 1")
        if not self.rerun and (
            self.nan_sample_at is not None or self.transient_fault_at is not None
        ):
            raise ValueError(f"{self.name}: nan_sample_at and transient_fault_at need rerun")
        if self.nan_sample_at is not None and self.nan_sample_at == self.transient_fault_at:
            raise ValueError(f"{self.name}: nan_sample_at and transient_fault_at must differ")
        for name in (
            "corrupt_from",
            "stale_restore_at",
            "bad_batch_at",
            "nan_sample_at",
            "transient_fault_at",
        ):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{self.name}: {name} must be a fraction within (0, 1)")

    def outliers_at(self, step: int, rank: int, world_size: int) -> bool:
        """Whether ``rank``'s batch of ``step`` holds outlier samples."""
        if self.outlier_rank is None:
            return False
        target = self.outlier_rank % world_size
        nth, rest = divmod(step, self.outlier_every)
        within = self.outlier_batches is None or nth <= self.outlier_batches
        return rank == target and rest == 0 and within

    def corrupt_at(self, step: int, steps: int) -> bool:
        """Whether every rank's inputs of ``step`` (of ``steps``) are corrupt."""
        return self.corrupt_from is not None and step > math.floor(self.corrupt_from * steps)

    def restore_step(self, steps: int) -> int | None:
        """The step after which the last rank reloads its stale scaler state, if any."""
        if self.stale_restore_at is None:
            return None
        return max(2, math.floor(self.stale_restore_at * steps))

    def bad_batch_step(self, steps: int) -> int | None:
        """The step whose batch is bad on the last rank, if any: the first past the fraction,
        so that at ``bad_batch_at=0.75`` a 30-step run has 22 clean iterations before it,
        enough for the spike rule's window of at least 20."""
        if self.bad_batch_at is None:
            return None
        return math.floor(self.bad_batch_at * steps) + 1

    def nan_sample_step(self, steps: int) -> int | None:
        """The step whose batch holds a NaN sample on the last rank, if any: the first past
        the fraction."""
        if self.nan_sample_at is None:
            return None
        return math.floor(self.nan_sample_at * steps) + 1

    def transient_fault_step(self, steps: int) -> int | None:
        """The step whose first pass corrupts rank 0's own gradients, if any: the first past
        the fraction."""
        if self.transient_fault_at is None:
            return None
        return math.floor(self.transient_fault_at * steps) + 1


SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            name="overflow",
            story="initial scale 2^20 is far too high: real fp16 gradient overflows back it "
            "off, then it keeps probing upwards every 10 steps",
            expect=(),
            init_scale=2.0**20,
            growth_interval=10,
        ),
        Scenario(
            name="hotspot",
            story="the last rank's data holds outlier samples every 5th step up to step 30: "
            "only that rank's gradients overflow, at a scale that trained cleanly (a fault, "
            "not the scaler's weather), and the all-reduce makes every rank skip",
            expect=("inf_hotspot",),
            init_scale=2.0**15,
            outlier_rank=-1,
            outlier_every=5,
            # Six, not more: each halves the scale (no growth in between: an overflow right
            # after a growth would be the scaler probing, weather), and a 60-step run
            # falling 2^8 would be a scale collapse too.
            outlier_batches=6,
            outlier_factor=1000.0,
        ),
        Scenario(
            name="collapse",
            story="halfway through, the inputs arrive unnormalized: the fp16 forward pass "
            "overflows, every step is skipped and the scale halves towards zero",
            expect=("scale_collapse", "skip_storm"),
            corrupt_from=0.5,
        ),
        Scenario(
            name="desync",
            story="at 40% of the run the last rank reloads a stale GradScaler state_dict: "
            "its scale no longer matches the other ranks'",
            expect=("scale_desync",),
            init_scale=2.0**10,
            growth_interval=4,
            stale_restore_at=0.4,
        ),
        Scenario(
            name="spike",
            story="at 3/4 of the run the last rank gets one bad batch, 20x larger than the "
            "rest but finite in fp16 at scale 2^5: its loss and its own gradients spike, "
            "and the step is not skipped",
            expect=("loss_spike", "grad_norm_spike", "origin_outlier"),
            # Measured on the demo's 2 ranks: the bad batch's gradients first overflow fp16
            # at scale 2^9 (60 steps) and 2^11 (30 steps), at a factor of 40 already at 2^6;
            # 2^5 leaves at least 8x headroom. With torch's growth interval of 2000 the scale
            # never grows, so every iteration before the spike joins the rule's window.
            init_scale=2.0**5,
            bad_batch_at=0.75,
            bad_batch_factor=20.0,
        ),
        Scenario(
            name="rerun",
            story="bad data or bad hardware: every rank passes a rerun closure; at 30% of the "
            "run one sample of the last rank's batch is NaN (the rerun reproduces it: the "
            "data), at 60% rank 0's own gradients turn inf once (the rerun does not: its "
            "device)",
            expect=("reproducible_fault", "transient_fault"),
            # As for the spike run: no overflow of its own at 2^5, so only the two planted
            # faults are flagged and rerun.
            init_scale=2.0**5,
            rerun=True,
            nan_sample_at=0.3,
            transient_fault_at=0.6,
        ),
    )
}
