"""The telemetry record schema, defined once.

The scalers build these records, the reporter sends them as JSON, and the exporter
validates every batch against the same models in strict mode. Limits that bound the
exporter's memory live here too, so both sides agree on them.

Only pydantic is imported: the rank side never pulls in the server stack.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from ampscope.reporter.fault_rule import CallKind, FaultKind, NonfiniteClass

SCHEMA_VERSION = 1
"""Bumped on any incompatible change; the exporter rejects other versions with 422."""

DEFAULT_PORT = 9478
"""The exporter's default port (one exporter per node)."""

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
"""Where a rank's reporter sends when ``AMPSCOPE_URL`` is unset."""

INGEST_PATH = "/api/v1/ingest"

# Limits of one record and one batch. The exporter applies further, configurable limits
# (body size, runs, ranks, series) on top of these.
MAX_LABEL_LENGTH = 128
"""run ids, node names, device strings and optimizer names."""
MAX_PARAM_NAME_LENGTH = 512
"""Fully qualified parameter names, e.g. ``layers.3.attn.wo.weight``."""
MAX_DEVICES = 64
"""Devices one rank may report in one record."""
MAX_OPTIMIZERS = 64
MAX_NONFINITE_PARAMS = 64
"""Upper bound on top-K non-finite parameters per record and per rank's cumulative totals."""
MAX_RECORDS_PER_BATCH = 2048
MAX_BATCH_IDS = 256
"""Sample or batch ids one rank keeps for one iteration (``note_batch``); the rest are
counted (``BatchIds.left_out``)."""
MAX_BATCH_ID_LENGTH = 128
"""Longest string id."""
MAX_COUNT = 2**53
"""Largest count or step: every integer up to it is exact as a float64, the type
Prometheus and JSON consumers hold samples in."""
MAX_TIME = 4_102_444_800.0
"""Latest record time accepted (2100-01-01 UTC); the exporter further refuses times
more than a small skew ahead of its own clock."""

SCALE_ALIGN_STEPS = 10
"""Every rank keeps its scale after each update() whose step is a multiple of this, so that
Prometheus can compare ranks at the same step whatever each rank's reporting lag."""

RUN_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*$"
"""Run ids: a label without ``/`` and not starting with ``.``, so every run id is one
path segment of the JSON API (``/api/v1/runs/{run}``) that no client normalises away."""

Label = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_LABEL_LENGTH, pattern=r"^[A-Za-z0-9_.:/@+=-]+$"),
]
"""A label value: printable, no whitespace or quotes, bounded."""
ParamName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PARAM_NAME_LENGTH, pattern=r"^[^\s\"\\]+$"),
]
RunId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_LABEL_LENGTH, pattern=RUN_ID_PATTERN)
]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Step = Annotated[int, Field(ge=1, le=MAX_COUNT)]
# Zero stays valid: a float32 scale that backed off ~150 times underflows to 0, which is
# exactly the collapse the health rules must see.
Scale = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
UnixTime = Annotated[float, Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)]

ScaleEvent = Literal["growth", "backoff", "none", "manual"]

RankMode = Literal["scaler", "watch"]
"""``scaler``: an fp16 loss scaler (``GradScaler``/``ShardedGradScaler``); ``watch``: a
``GradWatch`` on a bf16/fp32 run, which has no scale."""
Policy = Literal["observe", "skip", "raise"]
"""What happens to an iteration with non-finite gradients. A scaler always skips it."""


class _Model(BaseModel):
    # Strict: no coercion ("1" is not 1), unknown fields rejected, records immutable.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Identity(_Model):
    """Who produced a record."""

    run: RunId
    """Run id: AMPSCOPE_RUN_ID, else TORCHELASTIC_RUN_ID, else generated and shared by all ranks."""
    node: Label
    """Host name of the rank's machine."""
    rank: Annotated[int, Field(ge=0, lt=1_000_000)]
    local_rank: Annotated[int, Field(ge=0, lt=1_000_000)]
    world_size: Annotated[int, Field(ge=1, le=1_000_000)]
    local_world_size: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Ranks on the rank's node (torchrun's ``LOCAL_WORLD_SIZE``): equal to ``world_size``,
    the node holds the whole job, so its exporter can tell which ranks never reported."""
    job_id: Label | None = None
    """The scheduler's job id (see ``ampscope.rank.telemetry.identity.resolve_job_id``); ``None``
    when no scheduler said one, and from reporters that predate the field."""


class DeviceIdentity(_Model):
    """The hardware a rank runs on, named as GPU telemetry names it.

    Sent once per rank process (its first record) and, by the HTTP reporter, once per batch,
    never per step. DCGM-exporter labels its series with the same ``UUID``, ``pci_bus_id``
    and ``Hostname``, so one ``on (UUID)`` joins ampscope's offences with XID and ECC errors.
    """

    device: Label
    """On CUDA the GPU's UUID as NVML and DCGM-exporter write it (``GPU-…``); else
    ``<node>:<local_rank>``."""
    pci_bus_id: Label | None = None
    """The GPU's PCI address as NVML writes it (``00000000:3B:00.0``); ``None`` without a
    GPU, or when neither torch nor nvidia-ml-py could say."""
    hostname: Label
    """The machine's host name (``socket.gethostname()``; on Kubernetes ``NODE_NAME``, the
    node's name from the Downward API), whatever ``AMPSCOPE_NODE`` says: what
    DCGM-exporter's ``Hostname`` label (``hostname`` on its main branch) holds."""


class NonfiniteParam(_Model):
    """A parameter whose local gradient shard held inf/NaN values."""

    name: ParamName
    """Fully qualified name, or ``group{g}.param{i}`` when the model was not attached."""
    count: Count
    """Number of non-finite elements (in a record: this iteration; in totals: cumulative)."""


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_NamedT = TypeVar("_NamedT", bound=_Named)


def _unique_names(params: list[_NamedT]) -> list[_NamedT]:
    # Each name is one label set (e.g. of ampscope_nonfinite_grads_total); Prometheus would
    # keep one of two samples with the same labels and silently lose the other.
    seen: set[str] = set()
    for param in params:
        if param.name in seen:
            raise ValueError(f"parameter {param.name!r} is listed twice")
        seen.add(param.name)
    return params


NonfiniteParams = Annotated[
    list[NonfiniteParam], Field(max_length=MAX_NONFINITE_PARAMS), AfterValidator(_unique_names)
]
"""Top-K parameters, each name at most once."""


class OptimizerDetail(_Model):
    """One optimizer's part of an iteration."""

    index: Count
    """Order in which the scaler first saw this optimizer (0-based)."""
    name: Label
    """Optimizer class name, e.g. ``AdamW``."""
    found_inf: bool
    """Non-finite gradients after the cross-rank reduction: its step was skipped."""
    fused: bool
    """Took torch's ``_step_supports_amp_scaling`` path (the optimizer skips itself)."""


class OriginGroup(_Model):
    """The ranks whose origin norms (``grad_norm_origin``) are comparable with this rank's:
    those that hold the same parameters, the replicas of its data-parallel group (the DDP
    or FSDP1 process group, an FSDP2 data-parallel mesh, HSDP's replicate x shard mesh
    whole). A pipeline stage's or a tensor-parallel shard's norm covers other parameters
    than another stage's or shard's, so ranks of two groups are never compared."""

    first: Annotated[int, Field(ge=0, lt=1_000_000)]
    """The group's lowest global rank: data-parallel groups partition the ranks, so it names
    the group."""
    size: Annotated[int, Field(ge=1, le=1_000_000)]
    """Ranks in the group, on every node (1: no replica, nothing to compare with)."""


class Setup(_Model):
    """What a rank runs; the same in every record of a rank.

    Defaults describe an fp16 scaler, so records of reporters that predate this field
    stay valid under schema version 1.
    """

    mode: RankMode = "scaler"
    policy: Policy = "skip"
    """A watch's ``observe``, ``skip`` or ``raise``; ``skip`` for every torch scaler, and
    for a DeepSpeed fp16 engine until it is seen applying a step on inf/NaN gradients
    (then ``observe``: its records' ``skipped`` still say each step's fate)."""
    grad_dtype: Label | None = None
    """dtype of the gradients checked (``float16``, ``bfloat16``, ``float32``); ``None``
    when unknown."""
    # Left out of the JSON when None, so a rank without origin tracking sends (and the API
    # shows) the setup it always did, which an exporter that predates the field still takes.
    origin_group: OriginGroup | None = Field(default=None, exclude_if=lambda group: group is None)
    """With origin tracking, the data-parallel group whose collective the origin hooks sit
    in: the exporter compares a rank's origin norm with this group's only. ``None`` without
    origin tracking, and from reporters that predate the field (compared with every rank
    of the node that does not say either)."""


class NonfiniteApplied(_Model):
    """The first iteration whose optimizer step ran on non-finite gradients."""

    step: Step
    origin: bool | None
    """This rank's own, pre-reduction gradients held inf/NaN at that step; ``None`` when
    origin tracking is off."""


SpikeKind = Literal["loss", "grad_norm"]
"""What a rank's own spike rule (``ampscope.reporter.spike_rule``) judged a spike."""
Norm = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class ParamNorm(_Model):
    """A parameter and the L2 norm of its unscaled local gradient."""

    name: ParamName
    norm: Norm


class StepStats(_Model):
    """The iteration's loss and gradient norms, for spike detection.

    All three values are ``None`` on an iteration whose gradients were not finite (an
    overflow), and such iterations stay out of every spike window.
    """

    loss: Annotated[float, Field(allow_inf_nan=False)] | None
    """This rank's loss as passed to ``scale()``, unscaled; with gradient accumulation, the
    mean over the update's ``scale()`` calls. ``None`` when ``scale()`` was not called."""
    grad_norm: Norm | None
    """Total L2 norm of the unscaled gradients before clipping, over the whole model: what
    ``clip_grad_norm_`` returns after ``unscale_``; the same on every rank."""
    grad_norm_origin: Norm | None
    """L2 norm of this rank's own, unreduced, unscaled gradients (origin tracking), never
    divided by the world size; ``None`` without origin tracking."""
    spikes: list[SpikeKind] = Field(default=[], max_length=2)
    """What the rank's own spike rule flagged at this iteration."""
    top_params: Annotated[
        list[ParamNorm],
        Field(max_length=MAX_NONFINITE_PARAMS),
        AfterValidator(_unique_names),
    ] = []
    """On a spike iteration: the top-K local parameters by gradient norm, largest first."""


class AlignedScale(_Model):
    """A rank's loss scale after one update() whose step is a multiple of SCALE_ALIGN_STEPS."""

    step: Annotated[int, Field(ge=SCALE_ALIGN_STEPS, le=MAX_COUNT, multiple_of=SCALE_ALIGN_STEPS)]
    scale: Scale


class WeatherTotals(_Model):
    """The part of a rank's counters that the fault rule (``ampscope.reporter.fault_rule``)
    called the loss scaler's weather: its warm-up, its growth probes and its edge, where
    skipping the step and backing off is the scaler doing its job. Subsets of the
    :class:`RankTotals` counters of the same names, which that model enforces: each count at
    most its total's, each device one of its total's; what is left of them is what
    ``skip_storm`` and ``inf_hotspot`` count. All zero for a watch: without a scale nothing
    is weather."""

    skipped_steps: Count
    """Skipped iterations the rule called weather."""
    found_inf_local: dict[Label, Count] = Field(max_length=MAX_DEVICES)
    """Per device: ``found_inf_local`` detections on iterations the rule called weather; a
    device without an entry had none."""
    found_inf_origin: dict[Label, Count] = Field(max_length=MAX_DEVICES)
    """Per device: ``found_inf_origin`` detections on iterations the rule called weather."""


class RankTotals(_Model):
    """Cumulative counters of one rank since its scaler was created.

    Every record carries them, so the exporter's counters are exact even after
    dropped batches or an exporter restart.
    """

    steps: Count
    """update() calls."""
    skipped_steps: Count
    """Iterations whose optimizer step(s) were skipped for non-finite gradients."""
    backoffs: Count
    growths: Count
    found_inf_local: dict[Label, Count] = Field(max_length=MAX_DEVICES)
    """Per device: iterations whose local gradient shards held inf/NaN."""
    found_inf_origin: dict[Label, Count] = Field(max_length=MAX_DEVICES)
    """Per device: iterations whose pre-reduction gradients held inf/NaN (origin tracking)."""
    nonfinite_params: NonfiniteParams
    """Top-K parameters by cumulative non-finite element count on this rank."""
    min_scale: Scale | None
    max_scale: Scale | None
    aligned_scale: AlignedScale | None
    """The scale after the newest update() whose step is a multiple of SCALE_ALIGN_STEPS;
    ``None`` before the first such step. Ranks of a healthy run agree on it at equal steps."""
    nonfinite_applied: Count = 0
    """Iterations whose optimizer step ran on non-finite gradients (a watch under
    ``observe``): from the first one on, the weights hold inf/NaN. Always 0 for torch's
    scalers (a DeepSpeed fp16 engine that applied such a step counts it)."""
    first_nonfinite_applied: NonfiniteApplied | None = None
    """The first such iteration; ``None`` while there was none."""
    faults: dict[FaultKind, Count] | None = None
    """Iterations the fault rule (``ampscope.reporter.fault_rule``) called a fault of this
    rank's own (its own loss or gradients held inf/NaN), by kind; ``None`` from reporters
    that predate the rule. The loss scaler's weather is never counted."""
    clean_scale: Scale | None = None
    """The fault rule's clean scale: the newest scale at which the scaler trained cleanly
    (``scale_collapse`` measures the fall from it); ``None`` before one, for a watch, and
    from reporters that predate the rule."""
    weather: WeatherTotals | None = None
    """What of the counters above the fault rule called the scaler's weather; ``None`` from
    reporters that predate this field (their consumers count every skip and detection).
    Never more than the counter it is part of: see ``_weather_within_totals``."""

    @model_validator(mode="after")
    def _weather_within_totals(self) -> RankTotals:
        # Weather is a part of its totals, and PromQL subtracts one from the other label set
        # for label set: a part above its whole would make a negative count there, and a
        # device only the weather names would be a series without its total. A rank counts
        # both from the same flags of the same step, so its records always pass. O(devices
        # in the weather): nothing for the records of a rank that saw no weather.
        weather = self.weather
        if weather is None:
            return self
        if weather.skipped_steps > self.skipped_steps:
            raise ValueError(
                f"weather.skipped_steps ({weather.skipped_steps}) exceeds skipped_steps "
                f"({self.skipped_steps}), the total it is part of"
            )
        _within("found_inf_local", weather.found_inf_local, self.found_inf_local)
        _within("found_inf_origin", weather.found_inf_origin, self.found_inf_origin)
        return self


def _within(name: str, part: dict[str, int], whole: dict[str, int]) -> None:
    """Raise ``ValueError`` unless every device of ``part`` (the weather's ``name``) is one of
    ``whole`` (the totals' ``name``) with at least the same count."""
    for device, count in part.items():
        total = whole.get(device)
        if total is None:
            raise ValueError(f"weather.{name} names device {device!r}, which {name} does not hold")
        if count > total:
            raise ValueError(
                f"weather.{name}[{device!r}] ({count}) exceeds {name}[{device!r}] ({total}), "
                "the total it is part of"
            )


BatchId = (
    Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]
    | Annotated[
        str,
        StringConstraints(
            min_length=1, max_length=MAX_BATCH_ID_LENGTH, pattern=r"^[^\x00-\x1f\x7f]+$"
        ),
    ]
)
"""A sample or batch id: an integer exact as a float64, or a short printable string."""


class BatchIds(_Model):
    """The sample or batch ids a rank noted for one iteration (``note_batch``), in the order
    noted: the micro-batches of an accumulated update add up."""

    ids: list[BatchId] = Field(max_length=MAX_BATCH_IDS)
    """The first ``MAX_BATCH_IDS`` ids noted."""
    left_out: Count = 0
    """Ids noted beyond ``MAX_BATCH_IDS``, or not valid ids (a float, a long string, a
    device tensor), counted instead of kept."""


MAX_FP8_TENSORS = 3072
"""FP8 tensors one record may describe: three (input, weight, grad_output) for each of up
to 1024 ``Float8Linear`` layers."""

Fp8TensorName = Literal["input", "weight", "grad_output"]
"""The three tensors a ``Float8Linear`` casts to FP8."""
Fp8CastName = Literal["output_gemm", "grad_input_gemm", "fsdp_all_gather"]
"""Which cast the values describe: ``output_gemm``, the cast of ``input`` or ``weight`` for
the GEMM computing the output; ``grad_input_gemm``, the cast of ``grad_output`` for the
GEMM computing ``grad_input``; ``fsdp_all_gather``, the weight cast by FSDP2 per shard,
with the amax reduced over the shards, before the FP8 all-gather."""
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class Fp8Tensor(_Model):
    """What one ``Float8Linear`` layer's cast did to one of its tensors in one iteration."""

    layer: ParamName
    """The module's fully qualified name, e.g. ``layers.3.attention.wq``."""
    tensor: Fp8TensorName
    cast: Fp8CastName
    dtype: Label
    """The FP8 dtype, e.g. ``float8_e4m3fn``."""
    rowwise: bool
    """One scale per row (torchao's axiswise granularity) rather than one per tensor."""
    amax: Norm | None
    """Largest |value| of the high-precision tensor the layer cast; ``None`` when it was inf
    or NaN. ``grad_output`` under a loss scaler: unscaled (divided by the loss scale)."""
    underflow_ratio: Ratio
    """Share of the tensor's non-zero elements that the cast turned into zero."""
    scale: Scale | None
    """The scale the cast multiplied by (tensorwise), or the largest row scale (rowwise);
    ``None`` when not finite. ``grad_output`` under a loss scaler: the scale of the
    unscaled gradient (the cast's scale times the loss scale)."""
    scale_min: Scale | None
    """The smallest row scale (rowwise); the same as ``scale`` for tensorwise scaling."""
    calls: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    """Casts of this tensor combined (a layer run several times in the iteration: gradient
    accumulation, recomputation): the largest amax, the pooled underflow."""


def _unique_fp8(tensors: list[Fp8Tensor]) -> list[Fp8Tensor]:
    seen: set[tuple[str, str]] = set()
    for entry in tensors:
        key = (entry.layer, entry.tensor)
        if key in seen:
            raise ValueError(f"FP8 tensor {entry.tensor} of layer {entry.layer!r} is listed twice")
        seen.add(key)
    return tensors


RerunReason = Literal["nonfinite", "spike"]
"""Why an iteration was rerun: some rank's gradients (or loss) held inf/NaN (``nonfinite``),
else some rank's loss or the gradient norm reached its spike threshold (``spike``)."""


class RerunPass(_Model):
    """One pass of a rerun iteration, as this rank saw its own result."""

    loss: Annotated[float, Field(allow_inf_nan=False)] | None
    """The loss sum ``scale()`` saw; ``None`` without one or when not finite."""
    norm: Norm | None
    """This rank's own gradient norm: origin tracking's unreduced one, still multiplied by
    the loss scale, or without origin tracking the local gradients' after the collective;
    ``None`` when not finite or not known."""
    nonfinite: bool
    """This rank's own gradients (or loss) held inf/NaN."""


class Rerun(_Model):
    """A flagged iteration that every rank reran from the same batch (``rerun=closure``).
    The record's other fields describe the second pass, the one the optimizer step used."""

    reason: RerunReason
    flagged: bool
    """This rank's own first result was flagged: verdicts about the rerun name it."""
    reproduced: bool
    """The second pass reproduced the first (bit for bit, or within the tolerance given)."""
    first: RerunPass
    second: RerunPass


MAX_REPLICA_PARAMETERS = 16
"""Differing parameters a replica check names at most (the count is always given)."""
MAX_REPLICA_RANKS = 4096
"""Disagreeing ranks a replica check lists at most."""


class ReplicaCheckResult(_Model):
    """A replica check (``attach(model, replica_check_every=N)``): this rank's parameters
    compared bit for bit with the ranks that must hold the same values, after the
    optimizer step. Every rank of the replica group records the same result."""

    agree: bool
    """Every replica's fingerprints were equal."""
    replicas: Annotated[int, Field(ge=2, le=MAX_COUNT)]
    """Ranks compared (this rank's replica group)."""
    ranks: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] = Field(
        default_factory=list, max_length=MAX_REPLICA_RANKS
    )
    """Global ranks that disagree: the minority when a majority agrees, else (two replicas,
    a tie) every rank of the disagreement. Empty when they agree."""
    majority: bool = True
    """A strict majority held every differing value: ``ranks`` are the odd ones out."""
    parameters: list[ParamName] = Field(default_factory=list, max_length=MAX_REPLICA_PARAMETERS)
    """Names of the differing parameters (FSDP1: the original parameters), at most
    ``MAX_REPLICA_PARAMETERS``."""
    parameters_differing: Count = 0
    """How many parameters differ."""


class NonfiniteCall(_Model):
    """The fault rule's decision about a non-finite iteration (``ampscope.reporter.fault_rule``),
    made by the rank from its own scaler's history."""

    kind: NonfiniteClass
    """``weather`` (the loss scaler's own dynamics), ``fault`` or ``consequence`` (of an
    earlier non-finite update that was applied)."""
    reason: CallKind
    own: bool | None
    """This rank's own loss or gradients held inf/NaN; ``None``: origin not tracked."""
    clean_scale: Scale | None
    """The clean scale the iteration was judged against; ``None``: none yet."""


class StepRecord(_Model):
    """One iteration: everything one update() call saw and did on one rank."""

    identity: Identity
    step: Step
    """1-based count of update() calls on this rank."""
    time: UnixTime
    """Wall-clock time of the update() call (seconds since the epoch)."""
    found_inf_local: dict[Label, bool] = Field(max_length=MAX_DEVICES)
    """Per device: inf/NaN in this rank's local gradient shards, before the found-inf reduction."""
    found_inf_origin: dict[Label, bool] = Field(max_length=MAX_DEVICES)
    """Per device: inf/NaN in this rank's own gradients before the gradient collective.
    Empty when origin tracking is off."""
    found_inf_global: bool
    """Any optimizer saw inf/NaN after the cross-rank reduction."""
    skipped: bool
    """At least one optimizer.step() was skipped this iteration."""
    scale_before: Scale
    scale_after: Scale
    growth_tracker: Count
    event: ScaleEvent
    optimizers: list[OptimizerDetail] = Field(max_length=MAX_OPTIMIZERS)
    nonfinite_params: NonfiniteParams
    """Top-K local parameters holding non-finite gradients; only on overflow iterations."""
    totals: RankTotals
    setup: Setup = Setup()
    """What this rank runs: scaler or watch, its policy, its gradient dtype."""
    stats: StepStats | None = None
    """Loss and gradient norms; ``None`` when the rank runs with ``stats=False`` (or a
    reporter older than them)."""
    device: DeviceIdentity | None = None
    """The rank's device, on the first record of a rank process only (``None`` on the
    others, and from reporters that predate the field)."""
    batch: BatchIds | None = None
    """The iteration's sample or batch ids; ``None`` when the loop noted none."""
    fp8: (
        Annotated[list[Fp8Tensor], Field(max_length=MAX_FP8_TENSORS), AfterValidator(_unique_fp8)]
        | None
    ) = None
    rerun: Rerun | None = None
    """The iteration was flagged and rerun (``step(..., rerun=closure)``); ``None`` when not."""
    """The attached model's FP8 layers (torchao ``Float8Linear``) on an observed iteration
    (one in ``fp8_every``); ``None`` on others and without FP8 layers."""
    replicas: ReplicaCheckResult | None = None
    """This iteration's replica check (one in ``replica_check_every``); ``None`` on the
    others and where no parameter has a replica."""
    nonfinite: NonfiniteCall | None = None
    """On a non-finite iteration (inf/NaN gradients or loss, on this rank or after the
    reduction): the fault rule's decision; ``None`` on clean iterations and from reporters
    that predate the rule."""

    @model_validator(mode="after")
    def _rank_in_its_origin_group(self) -> StepRecord:
        # The exporter keys its origin comparison on the group: a group that cannot hold the
        # rank (or is larger than the job) is a reporter bug, not a group to compare within.
        group, who = self.setup.origin_group, self.identity
        if group is not None and (group.first > who.rank or group.size > who.world_size):
            raise ValueError(
                f"origin_group (first {group.first}, size {group.size}) cannot hold rank "
                f"{who.rank} of a world of {who.world_size}"
            )
        return self


class IngestBatch(_Model):
    """What a reporter POSTs to the exporter's ingest endpoint."""

    schema_version: Literal[1]
    records: list[StepRecord] = Field(min_length=1, max_length=MAX_RECORDS_PER_BATCH)
    """Oldest first; all from one rank (same run and rank)."""
    dropped_records: Count
    """Records this rank's reporter has dropped so far (cumulative)."""
    device: DeviceIdentity | None = None
    """The rank's device, repeated on every batch by the HTTP reporter, so that an exporter
    that restarted, or missed the record that carried it, learns it from the next batch."""

    @model_validator(mode="after")
    def _one_rank(self) -> IngestBatch:
        first = self.records[0].identity
        for record in self.records[1:]:
            if (record.identity.run, record.identity.rank) != (first.run, first.rank):
                raise ValueError("all records of a batch must come from one rank of one run")
        return self


MAX_FAILURE_MESSAGE = 1000
"""Characters of an exception's message a failure carries at most (the reporter cuts it)."""
MAX_FAILURE_ORIGIN_RANKS = 64
"""Origin ranks a failure names at most."""

MAX_SIGNAL = 64
"""The largest signal number (Linux' SIGRTMAX)."""

FailureKind = Literal["nonfinite_gradients", "exception"]
"""``nonfinite_gradients``: a ``GradWatch`` stopped training (``NonFiniteGradientsError``);
``exception``: any other exception."""
FailureSeenBy = Literal["watch", "uncaught", "thread", "with"]
"""Where the reporter saw the exception: ``watch``, the ``GradWatch`` raising it;
``uncaught``, the main thread's uncaught exception, on which the process ended; ``thread``,
another thread's uncaught exception; ``with``, a ``with`` block's exit."""


class RankFailure(_Model):
    """Why a rank ended ``failed``: the exception its training ended on."""

    kind: FailureKind
    exception: Annotated[
        str, StringConstraints(min_length=1, max_length=MAX_LABEL_LENGTH, pattern=r"^[^\s\"\\]+$")
    ]
    """The exception's class name, e.g. ``NonFiniteGradientsError``, ``RuntimeError``."""
    message: Annotated[str, StringConstraints(max_length=MAX_FAILURE_MESSAGE)]
    """``str(exception)``, cut to ``MAX_FAILURE_MESSAGE`` characters."""
    step: Count
    """The step it failed at: a ``NonFiniteGradientsError``'s own step, else the newest step
    the rank reported (the exception came after it)."""
    origin_ranks: (
        Annotated[
            list[Annotated[int, Field(ge=0, lt=1_000_000)]],
            Field(max_length=MAX_FAILURE_ORIGIN_RANKS),
        ]
        | None
    ) = None
    """For a non-finite stop: the ranks whose own gradients held inf/NaN before the
    reduction, as the error names them; ``None`` when origin tracking is off, and for other
    exceptions."""
    seen_by: FailureSeenBy


HEARTBEAT_PATH = "/api/v1/heartbeat"

HEARTBEAT_INTERVAL_S = 10.0
"""Seconds between a reporter's heartbeats while no record is sent, unless the exporter
asks for less (it answers every post with a quarter of its ``stale_after_s``)."""


MAX_PAUSE_REASON_LENGTH = 64
"""Longest pause reason (``ampscope.reporter.pause.MAX_REASON_LENGTH`` cuts to it)."""


class RankPause(_Model):
    """A heartbeat's word that its rank stops stepping on purpose (a checkpoint save, an
    evaluation): the exporter then calls it stalled only after ``pause_limit_s``."""

    reason: Annotated[
        str,
        StringConstraints(
            min_length=1, max_length=MAX_PAUSE_REASON_LENGTH, pattern=r"^[A-Za-z0-9_.:/@+=-]+$"
        ),
    ]
    """What the rank does meanwhile (``checkpoint``, ``eval``...), the newest open pause's."""
    seconds: Annotated[float, Field(ge=0.0, le=MAX_TIME, allow_inf_nan=False)]
    """Since the oldest open pause began, on the rank's monotonic clock."""


class Heartbeat(_Model):
    """What a reporter POSTs while its rank is alive but sends no records, and once when the
    rank's scaler closes (``final``).

    Records already prove a rank alive; a heartbeat covers evaluation, checkpointing and
    hangs, when no ``update()`` happens. The exporter ignores heartbeats of ranks it holds
    no record of.
    """

    schema_version: Literal[1]
    identity: Identity
    time: UnixTime
    """Wall-clock time the heartbeat was sent (seconds since the epoch)."""
    step: Count
    """Newest step the rank's reporter has sent."""
    final: bool
    """The rank's scaler closed (``close()``, garbage collection or interpreter exit): the
    rank ended and sends nothing more: ``finished``, or ``failed`` with a ``failure``."""
    dropped_records: Count
    """Records this rank's reporter has dropped so far (cumulative)."""
    failure: RankFailure | None = None
    """On a final heartbeat: the exception the rank's training ended on (the rank ended
    ``failed``); ``None``: it ended normally (``finished``). Never on a non-final one."""
    stop_signal: Annotated[int, Field(ge=1, le=MAX_SIGNAL)] | None = None
    """On a final heartbeat: the signal that stopped the rank (15: SIGTERM, which torchrun's
    elastic agent, Slurm and Kubernetes send): it ended ``stopped``, said goodbye, and is
    never ``lost``. ``None``: it ended by itself. Never on a non-final one. Added after
    ``failure``: a reporter sends it only when set, and sends the heartbeat again without it
    to an exporter that predates it (which refuses unknown fields), so that exporter reads
    the rank ``finished`` instead of losing it; an older reporter never sends it."""
    pause: RankPause | None = None
    """The rank stops stepping on purpose (``paused()``); ``None``: it does not say so.
    Omitted from the JSON when ``None``: exporters that predate it refuse unknown fields,
    and a reporter they refuse it from sends its heartbeats without it. Added after
    ``stop_signal``."""

    @model_validator(mode="after")
    def _failure_is_final(self) -> Heartbeat:
        if self.failure is not None and not self.final:
            raise ValueError("only a final heartbeat carries a failure")
        if self.stop_signal is not None and not self.final:
            raise ValueError("only a final heartbeat carries a stop_signal")
        return self
