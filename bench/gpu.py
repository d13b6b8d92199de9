"""``python -m bench.gpu``: ampscope on a GPU, proven and measured in one run.

Writes ``<out>/gpu-<device>.json`` (every figure, the device, torch and CUDA versions,
machine and commit) and ``<out>/gpu-<device>.md`` (the summary). Sections, most
important first:

1. ``syncs``: host-device syncs per iteration by phase under torch's sync debug mode,
   stock against ampscope (:mod:`bench.gpu_syncs`), on a small model.
2. ``profile``: synchronising CUDA calls and device-to-host copies per iteration in a
   torch.profiler trace of 20 iterations, stock against ampscope (:mod:`bench.gpu_profile`).
3. ``costs``: step-time ratios on the GPT-2-small-shaped model (fp16 autocast and
   AdamW, fused and not; bf16 GradWatch against a plain loop; fp16 loops that clip, ampscope
   through its ``clip_grad_norm_``), origin tracking's added
   time, and added peak memory (:mod:`bench.gpu_costs`).
4. ``event_wait``: the telemetry thread's CPU per step while it waits for the host
   copies, with a spin-waited event against the blocking one ampscope records
   (:mod:`bench.gpu_event_wait`).

``--device cpu --preset quick`` runs the same code on the CPU with a tiny model in
seconds: a dry run of the plumbing (the CPU has no sync debug mode; counts are zero).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpt import SHAPES, TINY, batch, build_gpt, parameter_count
from bench.gpu_report import render_markdown
from bench.machine import machine_info

log = logging.getLogger("bench.gpu")
SECTIONS = ("syncs", "profile", "costs", "event_wait")
RESULTS_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class GPUBenchConfig:
    """How much each section measures."""

    model: str = "gpt2-small"
    """Shape of the costs section's model (:data:`bench.gpt.SHAPES`)."""
    groups: int = 12
    """Block groups per step-time comparison."""
    steps_per_block: int = 10
    warmup_steps: int = 3
    sync_warmup: int = 3
    """Iterations before the sync passes: first allocations, identity, NCCL set-up."""
    sync_iterations: int = 5
    """Clean iterations per sync pass (census and strict)."""
    profile_iterations: int = 20
    memory_steps: int = 3
    event_wait_steps: int = 60
    """Steps per contender of the event-wait comparison."""
    reporter: bool = True
    """Add an ampscope contender reporting over HTTP to a live ``ampscope serve``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = {
    "full": GPUBenchConfig(),
    "quick": GPUBenchConfig(
        model="tiny",
        groups=2,
        steps_per_block=2,
        warmup_steps=1,
        sync_iterations=2,
        profile_iterations=2,
        memory_steps=1,
        event_wait_steps=2,
        reporter=False,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="full")
    parser.add_argument("--model", choices=tuple(SHAPES), help="override the preset's model")
    parser.add_argument("--groups", type=int, help="override the preset's block groups")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="repeatable")
    parser.add_argument(
        "--source-commit",
        help="the commit the measured tree was exported from, when it is a copy (no .git)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def device_info(device: torch.device) -> dict[str, Any]:
    """The device and the CUDA stack it runs on."""
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            driver=_driver_version(),
        )
    else:
        info["name"] = "cpu"
    return info


def _driver_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def guarded(fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``fn``'s result, or ``{"error": traceback}``: one failing part of a run on a lent
    machine must not cost the figures of the others."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        log.exception("%s failed", getattr(fn, "__name__", fn))
        return {"error": traceback.format_exc()}


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``: the results files' suffix."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


SYNC_PAIRS = (
    # label, precision, baseline spec, ampscope spec, phases allowed to sync
    ("GradScaler", "fp16", ("stock", "none"), ("ampscope", "none"), ("step",)),
    (
        "ShardedGradScaler (FSDP1, 1 rank)",
        "fp16",
        ("stock", "fsdp1"),
        ("ampscope", "fsdp1"),
        ("step",),
    ),
    (
        "origin tracking (DDP, 1 rank)",
        "fp16",
        ("stock", "ddp"),
        ("ampscope_origin", "ddp"),
        ("step",),
    ),
    ("GradWatch observe", "bf16", ("plain", "none"), ("watch", "none"), ()),
)


def run_syncs(config: GPUBenchConfig, device: torch.device) -> dict[str, Any]:
    from bench.gpu_setups import make_setup
    from bench.gpu_syncs import census_pair, control_raises

    base = build_gpt(TINY)
    inputs = batch(TINY, device)
    rows = []
    for fused in (False, True):
        for label, precision, (b_ctl, b_wrap), (o_ctl, o_wrap), allowed in SYNC_PAIRS:
            log.info("syncs: %s fused=%s", label, fused)
            stock, ours = (
                make_setup(
                    name,
                    base,
                    device=device,
                    controller=ctl,
                    precision=precision,
                    fused=fused,
                    wrap=wrap,
                )
                for name, ctl, wrap in (("baseline", b_ctl, b_wrap), ("ampscope", o_ctl, o_wrap))
            )
            try:
                result = guarded(
                    census_pair,
                    stock,
                    ours,
                    inputs,
                    warmup=config.sync_warmup,
                    iterations=config.sync_iterations,
                    allowed=allowed,
                )
            finally:
                stock.close()
                ours.close()
            rows.append({"setup": label, "fused": fused, **result})
    return {"model": TINY.as_dict(), "control_raises": control_raises(device), "pairs": rows}


PROFILE_PAIRS = (
    ("GradScaler", "fp16", False, ("stock", "none"), ("ampscope", "none")),
    ("GradScaler, fused AdamW", "fp16", True, ("stock", "none"), ("ampscope", "none")),
    ("origin tracking (DDP, 1 rank)", "fp16", False, ("stock", "ddp"), ("ampscope_origin", "ddp")),
    ("GradWatch observe", "bf16", False, ("plain", "none"), ("watch", "none")),
)


def run_profile(config: GPUBenchConfig, device: torch.device) -> dict[str, Any]:
    from bench.gpu_profile import profile_setup
    from bench.gpu_setups import make_setup

    base = build_gpt(TINY)
    inputs = batch(TINY, device)
    rows = []
    for label, precision, fused, *specs in PROFILE_PAIRS:
        log.info("profile: %s", label)
        row: dict[str, Any] = {"setup": label, "fused": fused}
        for role, (ctl, wrap) in zip(("baseline", "ampscope"), specs, strict=True):
            setup = make_setup(
                role,
                base,
                device=device,
                controller=ctl,
                precision=precision,
                fused=fused,
                wrap=wrap,
            )
            try:
                row[role] = guarded(
                    profile_setup,
                    setup,
                    inputs,
                    warmup=config.sync_warmup,
                    iterations=config.profile_iterations,
                )
            finally:
                setup.close()
        rows.append(row)
    return {"model": TINY.as_dict(), "pairs": rows}


def run_costs(config: GPUBenchConfig, device: torch.device) -> dict[str, Any]:
    from bench.gpu_costs import (
        BF16_SPECS,
        CLIP_SPECS,
        FP16_SPECS,
        REPORTER_SPEC,
        Spec,
        compare_groups,
        family_ab,
        memory_costs,
        summarize_fp16,
    )

    shape = SHAPES[config.model]
    base = build_gpt(shape)
    inputs = batch(shape, device)
    out: dict[str, Any] = {"model": shape.as_dict(), "parameters": parameter_count(base)}

    def timed(specs: tuple[Spec, ...], precision: str, fused: bool, url: str | None = None) -> Any:
        return family_ab(
            base,
            inputs,
            specs,
            device=device,
            precision=precision,
            fused=fused,
            groups=config.groups,
            steps_per_block=config.steps_per_block,
            warmup=config.warmup_steps,
            url=url,
        )

    def fp16_family(specs: tuple[Spec, ...], fused: bool, url: str | None) -> dict[str, Any]:
        blocks, telemetry_cpu = timed(specs, "fp16", fused, url)
        return {**summarize_fp16(blocks), "telemetry_cpu_s_per_step": telemetry_cpu}

    def bf16_family(fused: bool) -> dict[str, Any]:
        blocks, telemetry_cpu = timed(BF16_SPECS, "bf16", fused)
        return {
            **compare_groups(blocks, baseline="plain"),
            "telemetry_cpu_s_per_step": telemetry_cpu,
        }

    def clip_family(fused: bool) -> dict[str, Any]:
        blocks, telemetry_cpu = timed(CLIP_SPECS, "fp16", fused)
        return {
            **compare_groups(blocks, baseline="stock_clip"),
            "telemetry_cpu_s_per_step": telemetry_cpu,
        }

    for fused in (False, True):
        key = "fused" if fused else "non_fused"
        log.info("costs: fp16 %s", key)
        specs = FP16_SPECS
        url = None
        exporter = None
        if config.reporter and not fused:
            exporter, url = _start_exporter(out)
            if url is not None:
                specs = (*FP16_SPECS, REPORTER_SPEC)
        try:
            out[f"fp16_{key}"] = guarded(fp16_family, specs, fused, url)
        finally:
            if exporter is not None:
                exporter.__exit__(None, None, None)
        log.info("costs: bf16 %s", key)
        out[f"bf16_{key}"] = guarded(bf16_family, fused)
        log.info("costs: fp16 clipping %s", key)
        out[f"fp16_clip_{key}"] = guarded(clip_family, fused)
    log.info("costs: memory")
    memory = guarded(
        lambda: {"rows": memory_costs(base, inputs, device=device, steps=config.memory_steps)}
    )
    out["memory"] = memory.get("rows", memory)
    return out


def _machine(source_commit: str | None) -> dict[str, Any]:
    info = machine_info()
    if source_commit:
        # A copy of the tree (git archive): git would describe whatever checkout holds it.
        info.update(git_commit=source_commit, git_dirty=None, source="copy of the commit")
    return info


def run_event_wait(config: GPUBenchConfig, device: torch.device) -> dict[str, Any]:
    from bench.gpu_event_wait import event_wait_cost

    shape = SHAPES[config.model]
    rows = event_wait_cost(
        build_gpt(shape),
        batch(shape, device),
        device=device,
        steps=config.event_wait_steps,
        warmup=config.warmup_steps,
    )
    return {"model": shape.as_dict(), "rows": rows}


def _start_exporter(out: dict[str, Any]) -> tuple[Any, str | None]:
    """A live ``ampscope serve`` for the reporter contender; (None, None) if it cannot
    start (the reason is kept in ``out``)."""
    try:
        from bench.servers import ampscope_exporter

        context = ampscope_exporter()
        server = context.__enter__()
    except Exception as exc:
        # The exception's last line (its log tail ends with the cause), not its paths.
        out["reporter_error"] = str(exc).strip().splitlines()[-1]
        return None, None
    return context, f"http://{server.host}:{server.port}"


def run(
    args: argparse.Namespace, after_section: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the chosen sections; ``after_section(results so far)`` after each one."""
    from bench.gpu_setups import ProcessGroup

    config = PRESETS[args.preset]
    overrides = {k: v for k, v in (("model", args.model), ("groups", args.groups)) if v}
    if overrides:
        config = GPUBenchConfig(**{**config.as_dict(), **overrides})
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device available")
        torch.cuda.set_device(device)
    else:
        # One intra-op thread, as the CPU scaler bench runs: a tiny model gains nothing
        # from more, and other load on the host moves the times less.
        torch.set_num_threads(1)
    started = time.monotonic()
    results: dict[str, Any] = {
        "results_version": RESULTS_VERSION,
        "command": shlex.join(["python", "-m", "bench.gpu", *sys.argv[1:]]),
        "machine": _machine(args.source_commit),
        "device": device_info(device),
        "config": config.as_dict(),
    }
    sections = args.only or list(SECTIONS)
    runners = {
        "syncs": run_syncs,
        "profile": run_profile,
        "costs": run_costs,
        "event_wait": run_event_wait,
    }
    with ProcessGroup(device):
        for name in SECTIONS:
            if name in sections:
                section_start = time.monotonic()
                results[name] = guarded(runners[name], config, device)
                results[name]["duration_s"] = time.monotonic() - section_start
                results["duration_s"] = time.monotonic() - started
                if after_section is not None:
                    after_section(results)
    results["duration_s"] = time.monotonic() - started
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def write(results: dict[str, Any]) -> None:
        # After every section: a run cut short on a lent machine keeps what it measured.
        stem = f"gpu-{device_slug(results['device']['name'])}"
        json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
        try:
            text = json.dumps(results, indent=2, allow_nan=False)
        except ValueError:  # a NaN or infinity: keep the run's figures anyway, flagged
            results["non_finite_values"] = True
            text = json.dumps(results, indent=2)
        json_path.write_text(text + "\n")
        md_path.write_text(render_markdown(results))
        paths[:] = [json_path, md_path]

    results = run(args, after_section=write)
    write(results)
    json_path, md_path = paths
    print(f"wrote {json_path} and {md_path} in {results['duration_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
