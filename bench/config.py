"""How much to measure: the quick (CI smoke) and full (published figures) presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Mode = Literal["quick", "full"]


@dataclass(frozen=True, kw_only=True)
class ScalerBenchConfig:
    """Sizes of the scaler-overhead measurements."""

    width: int = 512
    """Hidden size of the benchmark MLP."""
    depth: int = 8
    """Residual blocks (LayerNorm + two Linear layers each): 6 parameter tensors per block."""
    batch: int = 64
    """Rows per step; with the defaults a step takes ~30 ms on one core of a 2020s server
    CPU (4.5M parameters in 50 tensors)."""
    groups: int = 36
    """Block groups per comparison; each runs one block of every contender, in an order
    that rotates and reverses from group to group (ABBA...; a multiple of 6 balances three)."""
    steps_per_block: int = 20
    """Timed training steps per block."""
    warmup_steps: int = 5
    """Untimed steps per variant before the first block."""
    micro_iterations: int = 12000
    """step()+update() calls per variant for the per-update cost on a tiny model (in
    blocks of 250: the difference to stock is small next to the noise of a shared host,
    so it takes many block groups)."""
    overflow_iterations: int = 60
    """Overflow iterations per variant for the attribution cost."""
    world_size: int = 2
    """Ranks of the distributed comparison (gloo, CPU)."""

    def __post_init__(self) -> None:
        for name in ("width", "depth", "batch", "groups", "steps_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.micro_iterations < 10 or self.overflow_iterations < 4:
            raise ValueError("micro_iterations >= 10 and overflow_iterations >= 4 required")
        if self.world_size < 2:
            raise ValueError("world_size must be >= 2 (the single-process case is separate)")


@dataclass(frozen=True, kw_only=True)
class ExporterBenchConfig:
    """Sizes of the exporter and Pushgateway load tests."""

    rank_counts: tuple[int, ...] = (8, 64)
    """Simulated ranks pushing at once, one thread and connection each."""
    requests_per_phase: int = 3200
    """Requests per ingest phase, split evenly over the ranks (at least 2 each)."""
    records_per_batch: int = 16
    """Records per ingest request: what a reporter flushes every 0.5 s at ~30 steps/s."""
    devices: int = 8
    """Devices per simulated rank (series per device-labelled family)."""
    top_k: int = 8
    """Non-finite parameters per simulated rank (series of the param-labelled family)."""
    scrapes: int = 50
    """Sequential GET /metrics per server, with 64 ranks loaded."""
    rss_checkpoints: tuple[int, ...] = (100_000, 1_000_000)
    """Records ingested (cumulative) at which the server's RSS is read."""
    rss_records_per_batch: int = 64
    """Records per request in the memory phase (a reporter catching up sends more)."""

    def __post_init__(self) -> None:
        if not self.rank_counts or min(self.rank_counts) < 1:
            raise ValueError("rank_counts must be non-empty and positive")
        if self.requests_per_phase < 1 or self.records_per_batch < 1 or self.scrapes < 1:
            raise ValueError("requests_per_phase, records_per_batch and scrapes must be >= 1")
        if list(self.rss_checkpoints) != sorted(set(self.rss_checkpoints)):
            raise ValueError("rss_checkpoints must be strictly increasing")

    @property
    def max_ranks(self) -> int:
        return max(self.rank_counts)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one ``python -m bench`` run measures."""

    mode: Mode
    scaler: ScalerBenchConfig
    exporter: ExporterBenchConfig

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def preset(mode: Mode) -> BenchConfig:
    """The quick preset (CI smoke, well under a minute) or the full one (~10 minutes)."""
    if mode == "full":
        return BenchConfig(mode=mode, scaler=ScalerBenchConfig(), exporter=ExporterBenchConfig())
    if mode == "quick":
        return BenchConfig(
            mode=mode,
            scaler=ScalerBenchConfig(
                width=256,
                depth=2,
                batch=16,
                groups=2,
                steps_per_block=4,
                warmup_steps=2,
                micro_iterations=100,
                overflow_iterations=6,
            ),
            exporter=ExporterBenchConfig(
                requests_per_phase=128,
                scrapes=5,
                rss_checkpoints=(2_000, 8_000),
            ),
        )
    raise ValueError(f"unknown mode {mode!r}")
