"""One demo session end to end: exporter up, ranks trained, summary printed."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ampscope.demo.exporter import DemoError, ExporterProcess, get_json, is_healthy
from ampscope.demo.report import (
    ampscope_command,
    health_lines,
    keep_serving_hint,
    missing_verdicts,
    rank_table,
    where_to_look,
)
from ampscope.demo.scenarios import SCENARIOS

STOP_TIMEOUT_S = 3.0
"""SIGTERM to the exporter, then SIGKILL after this long: with the ranks' second
(``runner.ABANDON_GRACE_S``), the demo and its children end within 5 s of a stop signal."""
MIN_STEPS = 30
"""The hotspot run's outliers come every 5th step (6 of them, up to step 30) and inf_hotspot
needs 5 of them, with room for the collapse run's second half to pass skip_storm's minimum of
10 steps, and for the spike run's bad batch (at 3/4) to follow the spike rule's minimum window
of 20 clean iterations."""


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What ``ampscope demo`` was asked to do (see its ``--help``)."""

    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    steps: int = 60
    ranks: int = 2
    port: int = 9478
    exporter_url: str | None = None
    """A running exporter to report to; ``None`` starts one on ``port``."""
    stale_after: float | None = None
    keep_serving: bool = False
    step_delay: float = 0.0
    progress_every: int = 10
    run_prefix: str | None = None
    """Run ids are ``{run_prefix}-{scenario}``; ``None``: ``demo-HHMMSS``."""
    argv: tuple[str, ...] = ()
    """The demo's options as given on the command line, for the line that says how to run
    it again with ``--keep-serving``."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.scenarios if name not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
        if len(set(self.scenarios)) != len(self.scenarios):
            raise ValueError("each scenario may be given once")
        if self.steps < MIN_STEPS:
            raise ValueError(
                f"--steps must be at least {MIN_STEPS}: fewer steps cannot reach the health "
                "rules' thresholds (inf_hotspot needs 5 detections, skip_storm 10 steps, the "
                "spike rules 20 clean iterations before the spike)"
            )
        if self.ranks < 2 and any(SCENARIOS[s].expect for s in self.scenarios):
            raise ValueError(
                "--ranks must be at least 2: the scenarios are about ranks disagreeing"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be within 1-65535, not {self.port}")
        if self.exporter_url is not None and (self.keep_serving or self.stale_after is not None):
            raise ValueError(
                "--keep-serving and --stale-after apply to the exporter the demo starts, "
                "not to one given with --exporter-url"
            )

    def run_ids(self) -> tuple[str, ...]:
        prefix = self.run_prefix or time.strftime("demo-%H%M%S")
        return tuple(f"{prefix}-{name}" for name in self.scenarios)


def _wait_for_final_step(base_url: str, run_id: str, steps: int, ranks: int) -> Any:
    """The run's ranks once every rank's last step and final record (the ranks closed their
    scalers: ``finished``) reached the exporter, or after 15 s."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            views = get_json(f"{base_url}/api/v1/runs/{run_id}/ranks")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            views = []
        if len(views) == ranks and all(
            view["step"] >= steps and view["state"] == "finished" for view in views
        ):
            return views
        if time.monotonic() > deadline:
            return views
        time.sleep(0.2)


def _summarize(
    options: DemoOptions, base_url: str, run_ids: tuple[str, ...], emit: Callable[[str], None]
) -> list[str]:
    """Print each run's ranks and verdicts; returns 'run: rule' for each missing verdict."""
    missing = []
    for name, run_id in zip(options.scenarios, run_ids, strict=True):
        scenario = SCENARIOS[name]
        views = _wait_for_final_step(base_url, run_id, options.steps, options.ranks)
        emit("")
        emit(f"run {run_id}: {scenario.story}")
        if not views:
            emit("  the exporter has no data for this run")
            missing += [f"{run_id}: {rule}" for rule in scenario.expect] or [f"{run_id}: data"]
            continue
        health = get_json(f"{base_url}/api/v1/runs/{run_id}/health")
        for line in [*rank_table(views), *health_lines(health, scenario.expect)]:
            emit(line)
        missing += [f"{run_id}: {rule}" for rule in missing_verdicts(health, scenario.expect)]
    return missing


def run_demo(options: DemoOptions, emit: Callable[[str], None] | None = None) -> int:
    """Run one demo session; returns the exit status (see ``ampscope.demo.main.run``).

    Raises:
        DemoError: the exporter could not start or be reached, or a rank failed.
    """
    out = emit or (lambda line: print(line, flush=True))
    exporter = None
    if options.exporter_url is not None:
        base_url = options.exporter_url.rstrip("/")
        if not is_healthy(base_url):
            raise DemoError(f"no exporter answers {base_url}/healthz (start one: ampscope serve)")
    else:
        exporter = ExporterProcess(options.port, stale_after=options.stale_after)
        base_url = exporter.url
    try:
        if exporter is not None:
            exporter.start()  # inside the try: a signal during start-up stops it too
        run_ids = options.run_ids()
        out(
            f"ampscope demo: {options.ranks} CPU ranks, FSDP2 fully_shard, fp16 compute, "
            f"{options.steps} steps; reporting to {base_url}"
        )
        for name, run_id in zip(options.scenarios, run_ids, strict=True):
            out(f"  {run_id:<28} {SCENARIOS[name].story}")
        out("")
        # torch loads here, after the exporter is known to be there.
        from ampscope.demo.runner import run_ranks
        from ampscope.demo.trainer import Plan

        plan = Plan(
            scenarios=tuple(SCENARIOS[name] for name in options.scenarios),
            run_ids=run_ids,
            steps=options.steps,
            exporter_url=base_url,
            progress_every=options.progress_every,
            step_delay=options.step_delay,
        )
        started = time.monotonic()
        run_ranks(plan, options.ranks, out)
        out(f"trained in {time.monotonic() - started:.1f}s")
        missing = _summarize(options, base_url, run_ids, out)
        out("")
        if missing:
            out("Expected verdicts that did not appear: " + "; ".join(missing))
        else:
            out("Every scenario drew the verdicts it was built to provoke.")
        out("")
        command = ampscope_command()
        if exporter is not None and not options.keep_serving:
            # A link printed is one that answers: none once the exporter has stopped.
            exporter.stop(STOP_TIMEOUT_S)
            for line in keep_serving_hint(command, options.argv):
                out(line)
            return 1 if missing else 0
        named = dict(zip(options.scenarios, run_ids, strict=True))
        hotspot, rerun = named.get("hotspot"), named.get("rerun")
        for line in where_to_look(base_url, run_ids, hotspot, rerun, command):
            out(line)
        if exporter is not None and options.keep_serving:
            # From the line that says so on, Ctrl-C (or SIGTERM, SIGHUP) is the way serving
            # ends: the status stays the verdict's.
            try:
                out("")
                out(
                    f"The exporter keeps serving at {base_url} (log: {exporter.log_path}); "
                    "Ctrl-C stops it."
                )
                exporter.wait()
            except KeyboardInterrupt:
                out("")
        return 1 if missing else 0
    finally:
        if exporter is not None:
            exporter.stop(STOP_TIMEOUT_S)
