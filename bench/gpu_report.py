"""The Markdown summary of a ``python -m bench.gpu`` results document."""

from __future__ import annotations

from typing import Any

from bench.gpu_setups import PHASES


def _failure(error: str) -> str:
    """The last line of a kept traceback: the exception."""
    lines = error.strip().splitlines()
    return lines[-1] if lines else "failed"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(entry: dict[str, Any]) -> str:
    return (
        f"{entry['median']:.4f} (95% CI {entry['ci_low']:.4f}-{entry['ci_high']:.4f}, "
        f"IQR {entry['p25']:.4f}-{entry['p75']:.4f})"
    )


def _header(results: dict[str, Any]) -> list[str]:
    device, machine = results["device"], results["machine"]
    lines = ["# ampscope on a GPU", ""]
    if device["type"] == "cuda":
        lines.append(
            f"{device['name']} ({device['memory_bytes'] / 2**30:.0f} GiB, "
            f"{device['multiprocessors']} SMs, compute {device['capability']}), driver "
            f"{device['driver']}; torch {device['torch']}, CUDA {device['cuda']}, "
            f"cuDNN {device['cudnn']}, NCCL {device['nccl']}."
        )
    else:
        lines.append(f"CPU dry run (no GPU): torch {device['torch']}.")
    lines += [
        f"Host: {machine['cpu_model']}, {machine['cpu_cores']} cores, Python "
        f"{machine['python']}. ampscope {machine['ampscope']}, commit "
        f"{machine['git_commit']}{' (dirty)' if machine['git_dirty'] else ''}, {machine['date']}.",
        f"Command: `{results['command']}` ({results['duration_s']:.0f} s).",
        "",
    ]
    return lines


def _syncs(section: dict[str, Any]) -> list[str]:
    lines = [
        "## Host-device syncs per iteration (sync debug mode)",
        "",
        f'Clean iterations after warm-up. `.item()` under `"error"` raises: '
        f'{section["control_raises"]}. Census: `"warn"` throughout, syncs counted by phase. '
        'Strict: `"error"` in every phase but the allowed one (`step()` for the scalers, '
        "where torch's own `.item()` of found-inf runs; none for the GradWatch).",
        "",
        "| setup | AdamW | stock syncs/it (step) | ampscope syncs/it ("
        + ", ".join(PHASES)
        + ") | added | strict pass | records (steps / dropped) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in section["pairs"]:
        if "error" in row:
            lines.append(
                f"| {row['setup']} | fused={row['fused']} | failed: {_failure(row['error'])} |"
            )
            continue
        base, ours = row["baseline"], row["ampscope"]
        mine = ours["census"]["per_iteration"]
        added = [v for v in row["added_per_iteration"].values() if v is not None]
        records = ours["records"]
        strict = ours["strict"]
        lines.append(
            f"| {row['setup']} | {'fused' if row['fused'] else 'foreach'} "
            f"| {_num(base['census']['per_iteration']['step'], 0)} "
            f"| {' / '.join(_num(mine[p], 0) for p in PHASES)} "
            f"| {_num(sum(added), 0) if added else '-'} "
            f"| {'error: ' + strict['error'] if strict['error'] else 'passed'} "
            f"({strict['iterations']} it) "
            f"| {records['steps'] if records else '-'} / {records['dropped'] if records else '-'}"
            f" of {ours['iterations_total']} |"
        )
    return [*lines, ""]


def _profile(section: dict[str, Any]) -> list[str]:
    lines = [
        "## Synchronising CUDA calls per iteration (torch.profiler)",
        "",
        "Per iteration over the profiled iterations, all host threads together (the JSON "
        "splits them by thread). The harness's closing synchronize and the profiler's own "
        "add two `cudaDeviceSynchronize` per run (0.10 per iteration over 20).",
        "",
        "| setup | contender | cudaStreamSynchronize | cudaEventSynchronize | "
        "cudaDeviceSynchronize | cudaMemcpy | D2H copies (to pageable / to pinned) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in section["pairs"]:
        for role in ("baseline", "ampscope"):
            counts = row[role]
            if "error" in counts:
                lines.append(f"| {row['setup']} | {role} | failed: {_failure(counts['error'])} |")
                continue
            parts = [part for part in counts.values() if isinstance(part, dict)]

            def total(key: str, parts: list[dict[str, float]] = parts) -> str:
                return f"{sum(part[key] for part in parts):.2f}"

            lines.append(
                f"| {row['setup']} | {role} | {total('cudaStreamSynchronize')} "
                f"| {total('cudaEventSynchronize')} | {total('cudaDeviceSynchronize')} "
                f"| {total('cudaMemcpy')} | {total('d2h_copies')} ({total('d2h_to_pageable')} / "
                f"{total('d2h_to_pinned')}) |"
            )
    return [*lines, ""]


def _costs(section: dict[str, Any]) -> list[str]:
    model = section["model"]
    lines = [
        "## Costs on the GPT-2-small-shaped model",
        "",
        f"{section['parameters'] / 1e6:.1f}M parameters ({model['layers']} layers, width "
        f"{model['width']}, {model['heads']} heads, vocabulary {model['vocab']}), batch "
        f"{model['batch']} x {model['context']} tokens, world size 1. Step time: device "
        "events around each step, contenders interleaved in blocks; ratio = median over "
        "block groups of (block median / baseline block median in the same group).",
        "",
        "| comparison | AdamW | baseline step (ms) | ratio |",
        "|---|---|---|---|",
    ]
    extra = []
    for key, optimizer in (("non_fused", "foreach"), ("fused", "fused")):
        fp16, bf16 = section[f"fp16_{key}"], section[f"bf16_{key}"]
        failed = [(n, f) for n, f in (("fp16", fp16), ("bf16", bf16)) if "error" in f]
        for name, family in failed:
            lines.append(f"| {name} family | {optimizer} | failed: {_failure(family['error'])} | |")
        if failed:
            continue
        single, ddp = fp16["single_process"], fp16["ddp"]
        stock_ms = single["samples"]["stock"]["median"]
        for name, entry in single["ratio"].items():
            lines.append(
                f"| fp16 {name} / stock | {optimizer} | {stock_ms:.2f} | {_ratio(entry)} |"
            )
        ddp_ms = ddp["samples"]["ddp_stock"]["median"]
        for name, entry in ddp["ratio"].items():
            lines.append(
                f"| fp16 DDP {name} / DDP stock | {optimizer} | {ddp_ms:.2f} | {_ratio(entry)} |"
            )
        plain_ms = bf16["samples"]["plain"]["median"]
        lines.append(
            f"| bf16 GradWatch observe / plain loop | {optimizer} | {plain_ms:.2f} "
            f"| {_ratio(bf16['ratio']['watch'])} |"
        )
        clip = section.get(f"fp16_clip_{key}")
        if clip is not None and "error" not in clip:
            clip_ms = clip["samples"]["stock_clip"]["median"]
            lines.append(
                f"| fp16 clipping, ampscope's clip_grad_norm_ / torch's | {optimizer} "
                f"| {clip_ms:.2f} | {_ratio(clip['ratio']['ampscope_clip'])} |"
            )
        elif clip is not None:
            lines.append(f"| fp16 clipping | {optimizer} | failed: {_failure(clip['error'])} | |")
        origin, added = fp16["origin_added_ms"], fp16["ampscope_added_ms"]
        cpu = {**fp16["telemetry_cpu_s_per_step"], **bf16["telemetry_cpu_s_per_step"]}
        cpu_text = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in cpu.items())
        extra.append(
            f"- {optimizer} AdamW: ampscope adds {added['median']:+.3f} ms per step (IQR "
            f"{added['p25']:+.3f} to {added['p75']:+.3f}); origin tracking adds "
            f"{origin['median']:+.3f} ms (IQR {origin['p25']:+.3f} to {origin['p75']:+.3f}), "
            f"{origin['share_of_step'] * 100:+.2f}% of the DDP step. Telemetry thread CPU "
            f"per step: {cpu_text}."
        )
    lines += ["", *extra, ""]
    if "reporter_error" in section:
        lines += [f"The reporter contender did not run: {section['reporter_error']}", ""]
    lines += [
        "### GPU memory",
        "",
        "Each setup alone on the device, a few iterations from a fresh copy (optimizer "
        "state included): bytes allocated at the peak and after, above what was allocated "
        "before.",
        "",
        "| setup | AdamW | stock peak | ampscope peak | added peak | added resident |",
        "|---|---|---|---|---|---|",
    ]
    memory = section["memory"]
    if isinstance(memory, dict):
        return [*lines, f"Failed: {_failure(memory['error'])}", ""]
    for row in memory:
        if row["stock"] is None:
            continue
        lines.append(
            f"| {row['setup']} | {'fused' if row['fused'] else 'foreach'} "
            f"| {row['stock']['peak_bytes']:,} | {row['ampscope']['peak_bytes']:,} "
            f"| {row['added_peak_bytes']:+,} B | {row['added_resident_bytes']:+,} B |"
        )
    return [*lines, ""]


def _event_wait(section: dict[str, Any]) -> list[str]:
    lines = [
        "## Telemetry thread waiting for the host copies",
        "",
        "ampscope's telemetry thread waits on the CUDA event recorded after each step's "
        "copy. CPU time it spent per step, with a default event (spin-waited) and with the "
        "blocking-sync event ampscope records; same model, fp16.",
        "",
        "| AdamW | event | step (ms) | telemetry CPU per step (ms) | share of step |",
        "|---|---|---|---|---|",
    ]
    for row in section["rows"]:
        lines.append(
            f"| {'fused' if row['fused'] else 'foreach'} | {row['event']} "
            f"| {row['step_s'] * 1e3:.2f} | {row['telemetry_cpu_s_per_step'] * 1e3:.3f} "
            f"| {row['telemetry_cpu_share_of_step'] * 100:.1f}% |"
        )
    return [*lines, ""]


def render_markdown(results: dict[str, Any]) -> str:
    lines = _header(results)
    for name, render in (
        ("syncs", _syncs),
        ("profile", _profile),
        ("costs", _costs),
        ("event_wait", _event_wait),
    ):
        section = results.get(name)
        if section is None:
            continue
        if "error" in section:
            lines += [f"## Section {name}: failed", "", f"`{_failure(section['error'])}`", ""]
            continue
        try:
            lines += render(section)
        except (KeyError, TypeError, ZeroDivisionError) as exc:  # keep the JSON's figures
            lines += [f"## Section {name}: not summarised ({exc!r}); see the JSON", ""]
    return "\n".join(lines)
