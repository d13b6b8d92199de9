"""The exporter's settings: every limit and threshold in one typed, validated place.

Read from ``AMPSCOPE_*`` environment variables (``AMPSCOPE_PORT=9500``), overridden by
``ampscope serve`` flags, and injected into the app by ``create_app(settings)``: nothing
reads them from a module-level global.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ampscope.exporter.state.lifecycle import Lifecycle
from ampscope.exporter.state.store import Store, StoreLimits
from ampscope.reporter.schema import (
    DEFAULT_PORT,
    MAX_DEVICES,
    MAX_NONFINITE_PARAMS,
    MAX_RECORDS_PER_BATCH,
)
from ampscope.verdicts.fp8 import Fp8Rule
from ampscope.verdicts.thresholds import Thresholds

_DEFAULTS = Thresholds()
_FP8 = Fp8Rule()
"""Health thresholds are defined once, in ``Thresholds`` (the FP8 rules' in ``Fp8Rule``);
settings take their defaults."""

Seconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Positive = Annotated[int, Field(ge=1)]


class Settings(BaseSettings):
    """Configuration of one exporter process.

    Cardinality limits bound memory: the exporter answers 429 naming the limit instead of
    growing without bound. Defaults fit a node of up to a few hundred ranks.
    """

    model_config = SettingsConfigDict(env_prefix="AMPSCOPE_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    """Bind address. Loopback by default: ranks report from the same node."""
    port: Annotated[int, Field(ge=0, le=65535)] = DEFAULT_PORT
    token: SecretStr | None = None
    """Bearer token ingest requires (env ``AMPSCOPE_TOKEN``, the variable ranks send), with
    surrounding whitespace stripped. ``None``: ingest is open. Reads (/metrics, the JSON
    API) never need it."""
    token_file: Path | None = None
    """File holding the token (surrounding whitespace stripped); wins over ``token``."""
    web_config_file: Path | None = None
    """The exporter-toolkit web configuration file: TLS, client certificates, basic-auth
    users and response headers (docs/security.md). Read by ``ampscope serve``, re-read when
    it or a certificate it names changes, and on SIGHUP."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = False
    """Log every request; off because every rank posts twice a second."""

    max_body_bytes: Positive = 8 * 1024 * 1024
    """Largest ingest body; larger ones get 413 before (Content-Length) or while reading."""
    max_records_per_batch: Annotated[int, Field(ge=1, le=MAX_RECORDS_PER_BATCH)] = (
        MAX_RECORDS_PER_BATCH
    )
    """More records in one batch get 413 (the reporter then sends smaller batches)."""
    max_runs: Positive = 64
    """Distinct run ids held at once (stale ones count until retention drops them)."""
    max_ranks_per_run: Positive = 4096
    max_ranks: Positive = 512
    """Ranks of all runs together: with ``max_series`` and ``history_bytes`` what bounds
    memory (docs/reliability.md, "Bounded memory")."""
    max_devices_per_rank: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 16
    """Distinct device labels one rank may report (each is a series per found-inf family)."""
    max_params_per_rank: Annotated[int, Field(ge=1, le=MAX_NONFINITE_PARAMS)] = 32
    """Non-finite parameters one rank may report (top K; each is a series)."""
    max_series: Positive = 50_000
    """Label sets across all per-rank families of all runs."""

    header_timeout_s: Seconds = 10.0
    """A connection must deliver its request line and headers within this long of opening
    (or of its next request's first byte), else 408 and close: slowloris clients cannot
    hold it."""
    body_timeout_s: Seconds = 30.0
    """A request body must arrive in full within this long of its headers, else 408 and
    close (8 MiB over a 10 Mbit/s link takes 7 s)."""
    keep_alive_timeout_s: Annotated[int, Field(ge=1)] = 30
    """An idle kept-alive connection is closed after this long. Reporters post every
    ~0.5 s over one connection, so theirs stay open."""
    max_connections: Positive = 512
    """Open connections at most; more are answered 503 at once. Keep it below the open
    file limit (``ampscope serve`` raises its soft limit to the hard one)."""
    max_inflight_bytes: Positive = 64 * 1024 * 1024
    """Ingest body bytes being received or parsed at once, over all requests; a body that
    does not fit gets 429 with ``Retry-After``. With ``max_body_bytes`` it bounds the
    memory that concurrent uploads can take."""

    history_length: Positive = 1024
    """StepRecords kept per rank for /history, the web view's charts and an origin outlier's
    top parameters."""
    history_bytes: Positive = 256 * 1024 * 1024
    """Bytes of history held across all ranks; past it the oldest records go first."""
    max_clock_skew_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 300.0
    """Records timed further ahead of the exporter's clock get 422 (``clock_skew``)."""
    history_limit_max: Positive = 1000
    """Most records one /history response returns; larger ``limit`` values are capped."""
    stale_after_s: Seconds = _DEFAULTS.stale_after_s
    """A rank not heard from (records or heartbeats) for this long, that never sent its final
    record, is lost: ``ampscope_rank_up`` 0. Reporters are told to beat 4x as often."""
    stall_after_s: Seconds = _DEFAULTS.stall_after_s
    """A rank still heard from but without a new step for this long is stalled."""
    pause_limit_s: Seconds = _DEFAULTS.pause_limit_s
    """The same for a rank whose heartbeats say it paused on purpose (a checkpoint save,
    an evaluation: ``scaler.paused("checkpoint")``); the larger of it and
    ``stall_after_s`` applies, so a pause never shortens the stall limit."""
    lost_critical_share: Annotated[float, Field(ge=0.0, le=1.0)] = _DEFAULTS.lost_critical_share
    """lost_rank turns critical when more than this share of a run's ranks are lost, and
    stopped_rank when more than this share of a world stopped alone."""
    stopped_grace_s: Seconds = _DEFAULTS.stopped_grace_s
    """A rank stopped by its launcher (SIGTERM) while ranks of its world still run is
    stopped_rank's after this long: long enough for an elastic restart to bring it back."""
    finished_retention_s: Seconds = 3600.0
    """A finished rank is dropped with its series this long after its final record."""
    retention_s: Seconds = 3600.0
    """A rank with no report for this long is dropped with its series; then empty runs."""
    prune_interval_s: Seconds = 10.0
    """How often the background task drops expired ranks and runs."""

    scale_floor: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = _DEFAULTS.scale_floor
    """Scale collapse: a scale below this is critical."""
    collapse_factor: Annotated[float, Field(gt=1.0, allow_inf_nan=False)] = (
        _DEFAULTS.collapse_factor
    )
    """Scale collapse: the scale fell by at least this factor within ``collapse_window_s``."""
    collapse_window_s: Seconds = _DEFAULTS.collapse_window_s
    skip_storm_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = _DEFAULTS.skip_storm_ratio
    """Skip storm: skipped / steps over ``skip_storm_window_s`` above this."""
    skip_storm_window_s: Seconds = _DEFAULTS.skip_storm_window_s
    skip_storm_min_steps: Positive = _DEFAULTS.skip_storm_min_steps
    hotspot_share: Annotated[float, Field(gt=0.0, le=1.0)] = _DEFAULTS.hotspot_share
    """Inf hotspot: one rank/device holds at least this share of the run's detections."""
    hotspot_window_s: Seconds = _DEFAULTS.hotspot_window_s
    hotspot_min_detections: Positive = _DEFAULTS.hotspot_min_detections
    spike_sigmas: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = _DEFAULTS.spike_sigmas
    """Loss/grad-norm spike: more than this many standard deviations above the mean of the
    rank's preceding window."""
    spike_window: Annotated[int, Field(ge=2)] = _DEFAULTS.spike_window
    """Preceding (non-overflow) iterations the spike test compares against."""
    spike_min_window: Annotated[int, Field(ge=2)] = _DEFAULTS.spike_min_window
    """No spike before this many preceding iterations are known (at most spike_window)."""
    spike_ratio: Annotated[float, Field(ge=1.0, allow_inf_nan=False)] = _DEFAULTS.spike_ratio
    """A spike is also at least this many times the window's median."""
    spike_verdict_window_s: Seconds = _DEFAULTS.spike_verdict_window_s
    """loss_spike, grad_norm_spike and origin_outlier keep firing while their newest spike is
    at most this old."""
    origin_outlier_factor: Annotated[float, Field(gt=1.0, allow_inf_nan=False)] = (
        _DEFAULTS.origin_outlier_factor
    )
    """Origin outlier: a rank's own gradient norm above this many times the median of the
    other ranks' at the same step."""
    nonfinite_skipped_window_s: Seconds = _DEFAULTS.nonfinite_skipped_window_s
    """nonfinite_skipped keeps warning while a watch under policy skip skipped a step for
    inf/NaN gradients within this long."""
    fp8_spike_factor: Annotated[float, Field(gt=1.0, allow_inf_nan=False)] = _FP8.spike_factor
    """fp8_amax_spike: an FP8 layer's amax at least this many times the median of its
    previous 100 observations (20 known at least)."""
    fp8_underflow_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = _FP8.underflow_ratio
    """fp8_underflow: more than this share of a tensor's non-zero elements underflowed in
    each of its last 5 observations."""
    fp8_max_layers: Annotated[int, Field(ge=1, le=1024)] = _FP8.max_layers
    """FP8 layers per rank exported on /metrics (those with a live verdict or the highest
    underflow); the JSON API holds all of them."""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.retention_s < self.stale_after_s:
            raise ValueError("retention_s must be at least stale_after_s")
        if self.spike_min_window > self.spike_window:
            raise ValueError("spike_min_window must be at most spike_window")
        if self.token_file is not None:
            try:
                text = self.token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(f"cannot read token_file {self.token_file}: {exc}") from exc
            if not text:
                raise ValueError(f"token_file {self.token_file} is empty")
            # frozen model: set through object.__setattr__ once, during validation.
            object.__setattr__(self, "token", SecretStr(text))
        elif self.token is not None:
            # Headers lose surrounding whitespace; an all-blank token means none.
            text = self.token.get_secret_value().strip()
            object.__setattr__(self, "token", SecretStr(text) if text else None)
        return self

    def thresholds(self) -> Thresholds:
        """The health rules' thresholds (the same numbers as the Prometheus alert rules)."""
        return Thresholds(**{f.name: getattr(self, f.name) for f in fields(Thresholds)})

    def store(self) -> Store:
        """A new, empty store with these limits, spike rule and origin-outlier factor: what
        ``create_app`` holds, and what ``bench.simulated_job`` builds per simulated node."""
        return Store(
            StoreLimits(
                max_runs=self.max_runs,
                max_ranks_per_run=self.max_ranks_per_run,
                max_series=self.max_series,
                history_length=self.history_length,
                window_s=self.window_s,
                max_ranks=self.max_ranks,
                history_bytes=self.history_bytes,
                max_clock_skew_s=self.max_clock_skew_s,
            ),
            spike_rule=self.thresholds().spike_rule(),
            origin_factor=self.origin_outlier_factor,
            fp8_rule=self.fp8_rule(),
        )

    def fp8_rule(self) -> Fp8Rule:
        """The FP8 rules' thresholds."""
        return Fp8Rule(
            spike_factor=self.fp8_spike_factor,
            underflow_ratio=self.fp8_underflow_ratio,
            max_layers=self.fp8_max_layers,
        )

    def lifecycle(self) -> Lifecycle:
        """The rank-state clocks (the API, /metrics and health all read the same ones)."""
        return Lifecycle.of(self.thresholds())

    @property
    def window_s(self) -> float:
        """The longest health window: how much per-rank sample history the store keeps."""
        return max(
            self.collapse_window_s,
            self.skip_storm_window_s,
            self.hotspot_window_s,
            self.nonfinite_skipped_window_s,
        )
