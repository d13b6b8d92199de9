"""The Markdown summary of a results document (``python -m bench`` writes it beside the JSON)."""

from __future__ import annotations

from typing import Any

MiB = 1024 * 1024


def _extra(micro: dict[str, Any], key: str, name: str) -> str:
    """``+36.5, IQR +30.1..+41.0`` (the IQR only where the result has one)."""
    text = f"{micro[key][name]:+.1f}"
    iqr = micro.get(f"{key}_iqr", {}).get(name)
    return text if iqr is None else f"{text}, IQR {iqr[0]:+.1f}..{iqr[1]:+.1f}"


def _f(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def _ratio(r: dict[str, Any]) -> str:
    return (
        f"{r['median']:.3f} (IQR {r['p25']:.3f}-{r['p75']:.3f}; "
        f"95% CI {r['ci_low']:.3f}-{r['ci_high']:.3f}; {r['groups']} groups)"
    )


def _machine(m: dict[str, Any]) -> list[str]:
    memory = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "?"
    commit = (m.get("git_commit") or "?")[:12] + (" (dirty)" if m.get("git_dirty") else "")
    load = ", ".join(f"{x:.2f}" for x in m["load_average"]) if m.get("load_average") else "?"
    end = m.get("load_average_end")
    if end:
        load += "; at end " + ", ".join(f"{x:.2f}" for x in end)
    return [
        f"- Date: {m['date']}; git commit {commit}",
        f"- CPU: {m['cpu_model']}, {m['cpu_cores']} cores ({m['cpu_cores_usable']} usable); "
        f"memory {memory}; load average (1, 5, 15 min) at start {load}",
        f"- OS: {m['os']} (kernel {m['kernel']}); Python {m['python']}; torch {m['torch']}; "
        f"ampscope {m['ampscope']}; Pushgateway: {m.get('pushgateway') or 'not installed'}",
    ]


def _scaler(s: dict[str, Any]) -> list[str]:
    single, dist = s["single_process"], s["distributed"]
    ss, ds = single["samples"], dist["samples"]
    micro, over = s["update_cost"], s["overflow"]
    lines = [
        f"## Scaler overhead ({s['device']}, {s['torch_threads']} intra-op thread per process)",
        "",
        "Step time: median ms per training step (forward, scaled backward, step, update); "
        "ratio: median over block groups of (ampscope block median / stock block median in "
        "the same group), contenders interleaved. The ms columns pool all blocks and move "
        "with other load on the host (see the load average); compare with the ratio.",
        "",
        "| Setup | stock ms | ampscope ms | ratio ampscope/stock |",
        "|---|---:|---:|---|",
        f"| 1 process, no reporter ({single['parameters']:,} params in "
        f"{single['parameter_tensors']} tensors) | {_f(ss['stock']['median'])} | "
        f"{_f(ss['ampscope_no_reporter']['median'])} | "
        f"{_ratio(single['ratio']['ampscope_no_reporter'])} |",
        f"| 1 process, reporter on | {_f(ss['stock']['median'])} | "
        f"{_f(ss['ampscope']['median'])} | {_ratio(single['ratio']['ampscope'])} |",
        f"| 1 process, no reporter, `stats=False` | {_f(ss['stock']['median'])} | "
        f"{_f(ss['ampscope_stats_off']['median'])} | "
        f"{_ratio(single['ratio']['ampscope_stats_off'])} |",
        f"| {dist['world_size']} ranks, {dist['wrapper']} on {dist['backend']}, reporter on | "
        f"{_f(ds['stock']['median'])} | {_f(ds['ampscope']['median'])} | "
        f"{_ratio(dist['ratio']['ampscope'])} |",
        f"| {dist['world_size']} ranks, plus origin tracking | {_f(ds['stock']['median'])} | "
        f"{_f(ds['ampscope_origin']['median'])} | {_ratio(dist['ratio']['ampscope_origin'])} |",
        "",
        f"Origin tracking alone (vs ampscope without it): "
        f"{_ratio(dist['origin_vs_ampscope'])}, "
        f"{dist['origin_vs_ampscope']['delta']:+.3f} ms per step. The loss and gradient "
        f"norms (stats on vs `stats=False`, 1 process): {_ratio(single['stats_vs_off'])}.",
        "",
        "Per-update cost: median us of `scaler.scale(loss)` + `scaler.step(opt)` + "
        "`scaler.update()` on a 16x16 "
        f"Linear ({micro['iterations_per_contender']} iterations each, in "
        f"{micro.get('groups', '?')} interleaved block groups); in brackets ampscope's extra "
        "cost, the median over block groups of (its block median - stock's in the same "
        "group), and that difference's interquartile range:",
        "",
        "| stock | ampscope, no reporter, `stats=False` | ampscope, no reporter "
        "| ampscope, HTTP reporter |",
        "|---:|---:|---:|---:|",
        f"| {_f(micro['step_update_us']['stock'], 1)} | "
        f"{_f(micro['step_update_us']['ampscope_stats_off'], 1)} "
        f"({_extra(micro, 'extra_us', 'ampscope_stats_off')}) | "
        f"{_f(micro['step_update_us']['ampscope_no_reporter'], 1)} "
        f"({_extra(micro, 'extra_us', 'ampscope_no_reporter')}) | "
        f"{_f(micro['step_update_us']['ampscope_reporter'], 1)} "
        f"({_extra(micro, 'extra_us', 'ampscope_reporter')}) |",
        f"| {_f(micro['step_update_cpu_us']['stock'], 1)} thread CPU | "
        f"{_f(micro['step_update_cpu_us']['ampscope_stats_off'], 1)} "
        f"({_extra(micro, 'extra_cpu_us', 'ampscope_stats_off')}) | "
        f"{_f(micro['step_update_cpu_us']['ampscope_no_reporter'], 1)} "
        f"({_extra(micro, 'extra_cpu_us', 'ampscope_no_reporter')}) | "
        f"{_f(micro['step_update_cpu_us']['ampscope_reporter'], 1)} "
        f"({_extra(micro, 'extra_cpu_us', 'ampscope_reporter')}) |",
        "",
        "The loss and gradient norms alone (stats on minus `stats=False`, paired): "
        f"{micro['stats_extra_us']['median']:+.1f} us wall "
        f"(IQR {micro['stats_extra_us']['p25']:+.1f} to {micro['stats_extra_us']['p75']:+.1f}), "
        f"{micro['stats_extra_cpu_us']['median']:+.1f} us thread CPU.",
        "",
        "Background threads, CPU per record: telemetry thread "
        f"{micro['telemetry_thread_cpu_us_per_record']:.1f} us (builds the record; "
        f"{micro['telemetry_thread_cpu_us_per_record_stats_off']:.1f} us with `stats=False`), "
        "reporter "
        f"thread {micro['reporter_thread_cpu_us_per_record']:.1f} us (encodes and sends it).",
        "",
        "Overflow iteration (inf/NaN in two parameters): median ms of `step()` + `update()` "
        f"on the benchmark model ({over['iterations_per_contender']} iterations each):",
        "",
        "| stock | ampscope, attribution off | ampscope, attribution on |",
        "|---:|---:|---:|",
        f"| {_f(over['step_update_ms']['stock'], 3)} | "
        f"{_f(over['step_update_ms']['attribution_off'], 3)} | "
        f"{_f(over['step_update_ms']['attribution_on'], 3)} "
        f"({over['attribution_extra_ms']:+.3f} for attribution) |",
        "",
        *(_watch(s["watch"]) if "watch" in s else []),
        f"The exporter accepted {s['exporter_records_received']:,.0f} records from the "
        f"reporters during these runs ({s['exporter_records_expected']:,} update() calls "
        "reported).",
        "",
    ]
    return lines


def _watch(w: dict[str, Any]) -> list[str]:
    """The GradWatch's per-iteration cost next to the plain bf16 loop."""
    lines = [
        "GradWatch (bf16 autocast, no scaler): median us of the plain loop's "
        "`optimizer.step()` and of `watch.scale(loss)` + `watch.step(opt)` + `watch.update()`; "
        "in brackets the "
        "watch's extra cost per iteration, paired per block group as above (wall clock, "
        "then training-thread CPU):",
        "",
        "| model | plain | observe | skip | observe, `stats=False` |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label in (("tiny", "16x16 Linear"), ("mlp", "benchmark MLP")):
        m = w[key]
        cells = [
            f"{_f(m['step_us'][f'watch_{p}'], 1)} ({_extra(m, 'extra_us', f'watch_{p}')}; "
            f"CPU {_extra(m, 'extra_cpu_us', f'watch_{p}')})"
            for p in ("observe", "skip", "observe_stats_off")
        ]
        lines.append(
            f"| {label} ({m['parameter_tensors']} tensors, {m['iterations_per_contender']} "
            f"iterations) | {_f(m['step_us']['plain'], 1)} | {cells[0]} | {cells[1]} "
            f"| {cells[2]} |"
        )
    syncs = w["tiny"]["syncs_per_iteration"]
    lines += [
        "",
        "Host-device syncs per iteration (torch's sync debug mode): "
        + (
            ", ".join(f"{n} {v:g}" for n, v in syncs.items())
            if syncs is not None
            else "not measured (CPU: there is no device to wait for)."
        ),
        "",
    ]
    return lines


def _exporter(e: dict[str, Any]) -> list[str]:
    ours, theirs = e["ampscope"], e["pushgateway"]
    both = "ingest" in theirs
    lines = ["## Exporter vs Pushgateway", ""]
    if not both:
        lines += [f"Pushgateway: {theirs.get('status', 'not run')}.", ""]
    biggest = str(max(int(k) for k in ours["ingest"]))
    body = ours["ingest"][biggest]["mean_body_bytes"] / 1024
    push = theirs["ingest"][biggest]["mean_body_bytes"] / 1024 if both else 0.0
    lines += [
        "Ingest: every simulated rank pushes back to back on its own keep-alive connection. "
        f"ampscope: POST of an IngestBatch of {ours['records_per_request']} records "
        f"(~{body:.1f} KiB); Pushgateway: PUT of the same rank's state as text exposition "
        f"(~{push:.1f} KiB; same families and label sets; it keeps only the newest values, "
        "so one push stands for one batch, and its records/s counts the records it stands "
        "for).",
        "",
        "| Ranks | Server | requests/s | records/s | p50 ms | p99 ms |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for count in sorted(ours["ingest"], key=int):
        targets = [("ampscope", ours)] + ([("Pushgateway", theirs)] if both else [])
        for name, data in targets:
            i = data["ingest"][count]
            lines.append(
                f"| {count} | {name} | {_f(i['requests_per_second'], 0)} | "
                f"{_f(i['records_per_second'], 0)} | {_f(i['latency_ms']['p50'])} | "
                f"{_f(i['latency_ms']['p99'])} |"
            )
    sc = ours["scrape"]
    lines += [
        "",
        f"Scrape of /metrics with {sc['ranks']} ranks x {sc['devices_per_rank']} devices x "
        f"{sc['params_per_rank']} parameters:",
        "",
        "| Server | samples | bytes | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, data in [("ampscope", ours)] + ([("Pushgateway", theirs)] if both else []):
        s = data["scrape"]
        lines.append(
            f"| {name} | {s['samples']:,} | {s['size_bytes']:,} | "
            f"{_f(s['latency_ms']['p50'])} | {_f(s['latency_ms']['p99'])} |"
        )
        z = data["scrape_gzip"]
        lines.append(
            f"| {name}, gzip | {s['samples']:,} | {z['size_bytes']:,} | "
            f"{_f(z['latency_ms']['p50'])} | {_f(z['latency_ms']['p99'])} |"
        )
        c = data["scrape_after_change"]["latency_ms"]
        lines.append(
            f"| {name}, gzip, every rank pushed since the last scrape | {s['samples']:,} | "
            f"{z['size_bytes']:,} | {_f(c['p50'])} | {_f(c['p99'])} |"
        )
    lines += ["", "Resident memory (RSS) of the server process:", ""]
    checkpoints = ours["memory"]["checkpoints"]
    header = " | ".join(f"after {c['records']:,} records" for c in checkpoints)
    lines += [
        f"| Server | idle | {header} |",
        "|---|---:|" + "---:|" * len(checkpoints),
    ]
    for name, data in [("ampscope", ours)] + ([("Pushgateway", theirs)] if both else []):
        mem = data["memory"]
        cells = " | ".join(f"{c['rss_bytes'] / MiB:.1f} MiB" for c in mem["checkpoints"])
        lines.append(f"| {name} | {mem['rss_start_bytes'] / MiB:.1f} MiB | {cells} |")
    mem = ours["memory"]
    lines += [
        "",
        f"ampscope RSS per held record: {mem['rss_per_held_record_bytes'] / 1024:.2f} KiB "
        f"(RSS growth from idle over the {mem['held_records']:,} records its history holds "
        "at the last checkpoint).",
    ]
    if both:
        r = e["ratio"]
        lines += [
            "",
            f"Ratios ampscope / Pushgateway: requests/s at {biggest} ranks "
            f"{r['ingest'][biggest]['requests_per_second']:.2f}, p99 latency "
            f"{r['ingest'][biggest]['latency_p99']:.2f}; scrape p50 "
            f"{r['scrape']['latency_p50']:.2f}, scrape size {r['scrape']['size_bytes']:.2f}; "
            f"final RSS {r['rss_final']:.2f}.",
        ]
    return [*lines, ""]


def render_markdown(results: dict[str, Any]) -> str:
    """A human summary of ``results``; every figure comes from the JSON beside it."""
    lines = [
        f"# ampscope benchmark ({results['mode']} mode)",
        "",
        f"Command: `{results['command']}` ({results['duration_s']:.0f} s)",
        "",
        *_machine(results["machine"]),
        "",
    ]
    if "scaler" in results:
        lines += _scaler(results["scaler"])
    gpu = results["gpu"]
    if gpu["status"] != "run":
        lines += [f"GPU (`--device cuda`): {gpu['status']}.", ""]
    if "exporter" in results:
        lines += _exporter(results["exporter"])
    return "\n".join(lines)
