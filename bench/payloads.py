"""Realistic telemetry for load tests: one simulated rank's records and pushes.

A :class:`SimulatedRank` produces what a real rank would send: ``IngestBatch`` JSON for
the ampscope exporter (built from the schema models, so the exporter's strict validation
sees real records), and the same state as Prometheus text exposition for a Pushgateway
(the same families and label sets as the exporter's per-rank families).

Clean records are rendered from a JSON template (about 2 us each) so that the load
generator, not the server, is never the slow side; overflow records (one in
``overflow_every``) and the cumulative totals are rebuilt through the pydantic models.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ampscope.exporter.metrics.catalogue import CATALOGUE, RANK_LABELS
from ampscope.reporter.schema import (
    SCALE_ALIGN_STEPS,
    SCHEMA_VERSION,
    AlignedScale,
    Identity,
    IngestBatch,
    NonfiniteParam,
    OptimizerDetail,
    RankTotals,
    StepRecord,
)
from ampscope.verdicts import aligned as aligned_sample

# Families the exporter computes itself rather than receives from a rank; a Pushgateway
# adds its own push_time_seconds instead.
_EXPORTER_SIDE = {
    "ampscope_rank_up",
    "ampscope_rank_state",
    "ampscope_last_report_timestamp_seconds",
    # Read from a failed rank's final heartbeat and a paused rank's heartbeats, not from its
    # records.
    "ampscope_rank_failure_info",
    "ampscope_rank_pause_start_timestamp_seconds",
    # The exporter's judgement of each rank's history (and of its ranks against each other).
    "ampscope_spikes_total",
    # Counted from records that carry a rerun and exposed once non-zero: a simulated rank,
    # like a healthy one, has none.
    "ampscope_reruns_total",
}
PUSHED_FAMILIES = tuple(
    spec
    for spec in CATALOGUE
    if spec.labels[: len(RANK_LABELS)] == RANK_LABELS and spec.name not in _EXPORTER_SIDE
)
"""The per-rank families, as a rank would push them to a Pushgateway."""

_STEP, _TIME, _TRACKER, _TOTALS = "@@step@@", "@@time@@", "@@tracker@@", "@@totals@@"
_SCALE = "@@scale@@"
_STEPS = 987654321  # stands for totals.steps in the cached totals JSON


@dataclass(kw_only=True)
class SimulatedRank:
    """One rank's telemetry, advanced one step per record.

    Args:
        run: Run id shared by all simulated ranks.
        rank: Global rank; ``node`` and ``local_rank`` derive from it (8 ranks per node).
        world_size: Number of simulated ranks.
        devices: Devices per rank (``cuda:0`` ...), all present in every record.
        top_k: Non-finite parameters tracked per rank; all present from the start so that
            the exporter's series count is at its maximum throughout.
        overflow_every: Every n-th step overflows (found inf, skipped, backoff); halfway
            between overflows the scale grows back, so it stays in a realistic range.
    """

    run: str
    rank: int
    world_size: int
    devices: int = 8
    top_k: int = 8
    overflow_every: int = 100
    step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.devices < 1 or self.top_k < 0 or self.overflow_every < 2:
            raise ValueError("devices >= 1, top_k >= 0 and overflow_every >= 2 required")
        self.identity = Identity(
            run=self.run,
            node=f"node{self.rank // 8}",
            rank=self.rank,
            local_rank=self.rank % 8,
            world_size=self.world_size,
        )
        self.device_names = [f"cuda:{d}" for d in range(self.devices)]
        self.param_names = [
            f"layers.{i}.attention.wo.weight" if i % 2 else f"layers.{i}.mlp.w1.weight"
            for i in range(self.top_k)
        ]
        self.scale = 65536.0
        self.tracker = 0
        self.skipped = self.backoffs = self.growths = 0
        self.found_local = {d: 1 for d in self.device_names}
        self.found_origin = {d: 1 for d in self.device_names}
        self.param_counts = {name: 1 for name in self.param_names}
        self.min_scale = self.max_scale = self.scale
        self.aligned: AlignedScale | None = None
        self._template = self._clean_template()
        self._totals_template = self._render_totals_template()

    # --- state ------------------------------------------------------------------------

    def _totals(self) -> RankTotals:
        top = sorted(self.param_counts.items(), key=lambda kv: -kv[1])[: self.top_k]
        return RankTotals(
            steps=self.step,
            skipped_steps=self.skipped,
            backoffs=self.backoffs,
            growths=self.growths,
            found_inf_local=dict(self.found_local),
            found_inf_origin=dict(self.found_origin),
            nonfinite_params=[NonfiniteParam(name=n, count=c) for n, c in top],
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            aligned_scale=self.aligned,
        )

    def _record(self, *, overflow: bool, scale_before: float, grew: bool = False) -> StepRecord:
        bad_device = self.device_names[self.step % self.devices]
        bad_params = self.param_names[: min(2, self.top_k)]
        return StepRecord(
            identity=self.identity,
            step=self.step,
            time=time.time(),
            found_inf_local={d: overflow and d == bad_device for d in self.device_names},
            found_inf_origin={d: overflow and d == bad_device for d in self.device_names},
            found_inf_global=overflow,
            skipped=overflow,
            scale_before=scale_before,
            scale_after=self.scale,
            growth_tracker=self.tracker,
            event="backoff" if overflow else "growth" if grew else "none",
            optimizers=[OptimizerDetail(index=0, name="AdamW", found_inf=overflow, fused=False)],
            nonfinite_params=(
                [NonfiniteParam(name=n, count=3) for n in bad_params] if overflow else []
            ),
            totals=self._totals(),
        )

    def _render_totals_template(self) -> str:
        """The totals' JSON with a placeholder for ``steps``; rebuilt when anything else in it
        changes (overflow, growth, a new aligned step)."""
        text = self._totals().model_copy(update={"steps": _STEPS}).model_dump_json()
        return text.replace(f'"steps":{_STEPS}', f'"steps":{_STEP}')

    def _clean_template(self) -> str:
        """JSON of a clean record with placeholders for what changes between clean steps."""
        self.step = 1  # a valid step for the model; the placeholders replace it
        data = json.loads(self._record(overflow=False, scale_before=self.scale).model_dump_json())
        self.step = 0
        data.update(
            step=_STEP,
            time=_TIME,
            growth_tracker=_TRACKER,
            totals=_TOTALS,
            scale_before=_SCALE,
            scale_after=_SCALE,
        )
        text = json.dumps(data, separators=(",", ":"))
        for placeholder in (_STEP, _TIME, _TRACKER, _TOTALS, _SCALE):
            text = text.replace(f'"{placeholder}"', placeholder)
        return text

    def _advance(self) -> str:
        """Move one step on and return that step's record as JSON."""
        self.step += 1
        scale_before = self.scale
        overflow = self.step % self.overflow_every == 0
        grew = False
        if overflow:
            self.scale /= 2.0
            self.tracker = 0
            self.skipped += 1
            self.backoffs += 1
            self.found_local[self.device_names[self.step % self.devices]] += 1
            self.found_origin[self.device_names[self.step % self.devices]] += 1
            for name in self.param_names[: min(2, self.top_k)]:
                self.param_counts[name] += 3
            self.min_scale = min(self.min_scale, self.scale)
        else:
            self.tracker += 1
            if self.tracker == self.overflow_every // 2:
                self.scale *= 2.0
                self.tracker = 0
                self.growths += 1
                self.max_scale = max(self.max_scale, self.scale)
                grew = True
        aligned = self.step % SCALE_ALIGN_STEPS == 0
        if aligned:
            self.aligned = AlignedScale(step=self.step, scale=self.scale)
        if overflow or grew or aligned:
            self._totals_template = self._render_totals_template()
        if overflow or grew:
            record = self._record(overflow=overflow, scale_before=scale_before, grew=grew)
            return record.model_dump_json()
        return (
            self._template.replace(_TOTALS, self._totals_template)
            .replace(_STEP, str(self.step))
            .replace(_SCALE, repr(self.scale))
            .replace(_TIME, repr(time.time()))
            .replace(_TRACKER, str(self.tracker))
        )

    # --- payloads ---------------------------------------------------------------------

    def ingest_batch(self, records: int, *, dropped: int = 0) -> bytes:
        """The next ``records`` steps as an ``IngestBatch`` JSON body (oldest first)."""
        body = ",".join(self._advance() for _ in range(records))
        return (
            f'{{"schema_version":{SCHEMA_VERSION},"records":[{body}],"dropped_records":{dropped}}}'
        ).encode()

    def exposition(self, *, dropped: int = 0) -> bytes:
        """The rank's current state as Prometheus text exposition for a Pushgateway push.

        ``run`` and ``rank`` are left out of the body: they are the push's grouping key
        (``/metrics/job/ampscope/run/<run>/rank/<rank>``), which the Pushgateway adds.
        """
        base = f'node="{self.identity.node}",local_rank="{self.identity.local_rank}"'
        values: dict[str, list[tuple[str, float]]] = {
            # A simulated rank is an fp16 scaler.
            "ampscope_rank_info": [
                (
                    ',mode="scaler",policy="skip",grad_dtype="float16"'
                    f',world_size="{self.identity.world_size}",job_id=""'
                    # A simulated rank has no GPU: its node and local rank name its device.
                    f',device="{self.identity.node}:{self.identity.local_rank}"'
                    ',pci_bus_id="",hostname=""',
                    1,
                )
            ],
            "ampscope_loss_scale": [("", self.scale)],
            "ampscope_growth_tracker": [("", self.tracker)],
            "ampscope_last_step": [("", self.step)],
            # A simulated rank reports no stats (loss, gradient norms): no samples.
            "ampscope_loss": [],
            "ampscope_grad_norm": [],
            "ampscope_grad_norm_origin": [],
            "ampscope_loss_scale_aligned": [("", self.aligned.scale)] if self.aligned else [],
            "ampscope_loss_scale_aligned_step": [("", self.aligned.step)] if self.aligned else [],
            "ampscope_loss_scale_aligned_packed": (
                [("", aligned_sample.pack(self.aligned.step, self.aligned.scale))]
                if self.aligned
                else []
            ),
            "ampscope_steps_total": [("", self.step)],
            "ampscope_skipped_steps_total": [("", self.skipped)],
            "ampscope_scale_backoffs_total": [("", self.backoffs)],
            "ampscope_scale_growths_total": [("", self.growths)],
            "ampscope_found_inf_total": [
                (f',device="{d}"', c) for d, c in self.found_local.items()
            ],
            "ampscope_found_inf_origin_total": [
                (f',device="{d}"', c) for d, c in self.found_origin.items()
            ],
            "ampscope_nonfinite_grads_total": [
                (f',param="{n}"', c) for n, c in self.param_counts.items()
            ],
            "ampscope_nonfinite_updates_applied_total": [("", 0)],
            "ampscope_reporter_dropped_records_total": [("", dropped)],
            # A simulated rank trains no FP8 (torchao Float8Linear) layers.
            "ampscope_fp8_amax": [],
            "ampscope_fp8_underflow_ratio": [],
            "ampscope_fp8_scale": [],
            "ampscope_fp8_nonfinite_amax_total": [],
            # A simulated rank's reporter predates the fault rule (and its weather count)
            # and the replica check.
            "ampscope_loss_scale_clean": [],
            "ampscope_faults_total": [],
            "ampscope_weather_skipped_steps_total": [],
            "ampscope_weather_found_inf_total": [],
            "ampscope_weather_found_inf_origin_total": [],
            "ampscope_replica_checks_total": [],
        }
        lines: list[str] = []
        for spec in PUSHED_FAMILIES:
            lines.append(f"# HELP {spec.name} {spec.help}")
            lines.append(f"# TYPE {spec.name} {spec.type}")
            lines.extend(
                f"{spec.name}{{{base}{extra}}} {value!r}" for extra, value in values[spec.name]
            )
        return ("\n".join(lines) + "\n").encode()

    def push_path(self) -> str:
        """The Pushgateway grouping-key path of this rank."""
        return f"/metrics/job/ampscope/run/{self.run}/rank/{self.rank}"


def check_batch(body: bytes) -> IngestBatch:
    """Validate a body exactly as the exporter does (strict); raises on any mismatch."""
    return IngestBatch.model_validate_json(body)
