"""``python -m bench.devices_at_scale``: ``ampscope devices`` over a fleet's 30 days, held by
VictoriaMetrics.

Loads a fresh single-node VictoriaMetrics, through its Prometheus import endpoint, with what
the exporters of ``--devices`` GPUs would have exposed over ``--runs`` runs spread across the
last 30 days: for every run, the offence series of the devices that offended in it
(``ampscope_device_offences_total`` by kind and
``ampscope_device_last_offence_timestamp_seconds``, one sample per ``--interval`` for the
run's ``--run-hours``), each device in at least one run and ``--repeaters`` devices in many
(the worst case for the command: every device listed), and DCGM-exporter's five error
fields for every GPU over the 30 days (one sample per ``--dcgm-interval``), a few with XID
errors. Then measures ``ampscope devices --prometheus URL --json`` as a user runs it (a new
process: Python start-up and imports included), first call and the median of
``--repeats`` more, checks its answer, and times each of its queries alone (``nocache=1``).

Writes ``<out>/devices-at-scale.json`` and ``.md``. Standalone (not part of
``python -m bench``); needs ``victoria-metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampscope.devices import query
from bench.servers import VICTORIA_METRICS, victoria_metrics
from bench.victoria import VictoriaClient

DAY_S = 86_400.0
WINDOW_S = 30 * DAY_S
XID_DEVICES = 10
"""Devices 0..9 carry an XID 79 in DCGM-exporter's series."""


def uuid(device: int) -> str:
    return f"GPU-{device:08x}-0000-4000-8000-{device:012x}"


def node(device: int) -> str:
    return f"node{device // 8:05d}"


def offenders(run: int, devices: int, runs: int, repeaters: int) -> list[int]:
    """The devices that offended in ``run``: a share of the fleet, so that every device
    offends once over all runs, and one of the ``repeaters`` in every run."""
    per_run = -(-devices // runs)
    own = [(run * per_run + k) % devices for k in range(per_run)]
    return sorted({*own, run % repeaters})


def offence_bodies(args: argparse.Namespace, now: float) -> Iterator[tuple[bytes, int]]:
    """(exposition text with millisecond timestamps, samples) per run."""
    step_ms = int(args.interval * 1000)
    samples_per_series = int(args.run_hours * 3600 / args.interval)
    span = WINDOW_S - DAY_S - args.run_hours * 3600  # every run ends within the window
    for run in range(args.runs):
        start = now - WINDOW_S + DAY_S / 2 + span * run / args.runs
        start_ms = int(start * 1000)
        lines = []
        for device in offenders(run, args.devices, args.runs, args.repeaters):
            labels = f'run="run-{run:04d}",device="{uuid(device)}",node="{node(device)}"'
            kinds = ["nonfinite_origin"] + (["transient_fault"] if device % 5 == 0 else [])
            for i in range(samples_per_series):
                t = start_ms + i * step_ms
                count = 1 + i * 3 // samples_per_series  # 1 to 3 offences over the run
                for kind in kinds:
                    lines.append(
                        f'ampscope_device_offences_total{{{labels},kind="{kind}"}} {count} {t}'
                    )
                lines.append(
                    f"ampscope_device_last_offence_timestamp_seconds{{{labels}}} "
                    f"{start + (count - 1) * args.run_hours * 1200:.3f} {t}"
                )
        yield ("\n".join(lines) + "\n").encode(), len(lines)


def dcgm_bodies(
    args: argparse.Namespace, now: float, points: int | None = None
) -> Iterator[tuple[bytes, int]]:
    """DCGM-exporter's error fields of every GPU, in chunks of 500 GPUs: over the 30 days,
    or only the newest ``points``."""
    step_ms = int(args.dcgm_interval * 1000)
    if points is None:
        points = int((WINDOW_S - 3600) / args.dcgm_interval)
    # The newest sample a minute old: a DCGM-exporter scraped now, as instant queries see it.
    first_ms = int((now - 60) * 1000) - (points - 1) * step_ms
    for chunk in range(0, args.devices, 500):
        lines = []
        for device in range(chunk, min(chunk + 500, args.devices)):
            labels = (
                f'UUID="{uuid(device)}",gpu="{device % 8}",device="nvidia{device % 8}",'
                f'pci_bus_id="00000000:{0x18 + device % 8:02X}:00.0",Hostname="{node(device)}",'
                'modelName="NVIDIA H100 80GB HBM3"'
            )
            for field in query.DCGM_FIELDS:
                value = 79 if field == "DCGM_FI_DEV_XID_ERRORS" and device < XID_DEVICES else 0
                for i in range(points):
                    lines.append(f"{field}{{{labels}}} {value} {first_ms + i * step_ms}")
        yield ("\n".join(lines) + "\n").encode(), len(lines)


def load(client: VictoriaClient, args: argparse.Namespace, now: float) -> dict[str, Any]:
    started = time.perf_counter()
    offence_samples = dcgm_samples = 0
    for body, count in offence_bodies(args, now):
        client.import_prometheus(body, {"job": "ampscope"})
        offence_samples += count
    for body, count in dcgm_bodies(args, now):
        client.import_prometheus(body, {"job": "dcgm"})
        dcgm_samples += count
    client.flush()
    return {
        "offence_samples": offence_samples,
        "dcgm_samples": dcgm_samples,
        "seconds": time.perf_counter() - started,
    }


def run_devices(url: str) -> tuple[float, int, list[dict[str, Any]]]:
    """(seconds, exit status, answer) of ``ampscope devices --prometheus url --json``."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "devices", "--prometheus", url, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise RuntimeError(f"ampscope devices failed ({done.returncode}): {done.stderr}")
    return seconds, done.returncode, json.loads(done.stdout)


def measure(client: VictoriaClient, args: argparse.Namespace) -> dict[str, Any]:
    # Loading takes minutes: DCGM-exporter's newest scrape, a minute before the command
    # runs, as instant queries would find it in a live fleet.
    now = time.time() + 60
    for body, _ in dcgm_bodies(args, now, points=1):
        client.import_prometheus(body, {"job": "dcgm"})
    client.flush()
    # Until VictoriaMetrics answers with them: on a busy host, samples imported just now
    # were seen to be searchable only some seconds after the flush.
    waited = time.perf_counter()
    expected = min(XID_DEVICES, args.devices)
    while len(client.query(query.dcgm_query(), time.time())[1]) < expected:
        if time.perf_counter() - waited > 300:
            raise RuntimeError("the fresh DCGM samples did not become searchable")
        time.sleep(1)
    waited = time.perf_counter() - waited
    first, code, answer = run_devices(client.url)
    again = [run_devices(client.url)[0] for _ in range(args.repeats)]
    repeaters = {uuid(d) for d in range(args.repeaters)}
    expected_runs = args.runs // args.repeaters  # at least: one run in every `repeaters`
    checks = {
        "exit_status": code,
        "devices_listed": len(answer),
        "every_device_listed": len(answer) == args.devices,
        "repeaters_first": {d["device"] for d in answer[: args.repeaters]} == repeaters,
        "repeater_runs": sorted({d["runs"] for d in answer[: args.repeaters]}),
        "repeaters_in_enough_runs": all(
            d["runs"] >= expected_runs for d in answer[: args.repeaters]
        ),
        "xid_found": sum(1 for d in answer if d["dcgm"].get("DCGM_FI_DEV_XID_ERRORS") == 79),
    }
    queries = {
        "offences": query.offences_query("30d"),
        "last_offence": query.last_offence_query("30d"),
        "dcgm": query.dcgm_query(),
    }
    timed = {}
    for name, promql in queries.items():
        runs = [client.query(promql, time.time()) for _ in range(1 + args.repeats)]
        timed[name] = {
            "cold_s": runs[0][0],
            "median_s": statistics.median(seconds for seconds, _ in runs[1:]),
            "samples": len(runs[0][1]),
            "query_bytes": len(promql),
        }
    return {
        "searchable_after_s": waited,
        "command_first_s": first,
        "command_median_s": statistics.median(again),
        "checks": checks,
        "queries": timed,
    }


def render_markdown(results: dict[str, Any]) -> str:
    m, load_ = results["measured"], results["load"]
    lines = [
        "# `ampscope devices` at scale (VictoriaMetrics)",
        "",
        f"{results['devices']:,} GPUs, {results['runs']:,} runs over 30 days "
        f"({results['run_hours']:g} h each, one sample per {results['interval_s']:g} s), "
        f"{results['repeaters']} repeat offenders; DCGM-exporter's 5 error fields per GPU, "
        f"one sample per {results['dcgm_interval_s']:g} s. VictoriaMetrics "
        f"{results['victoria_metrics']}; {load_['offence_samples']:,} offence and "
        f"{load_['dcgm_samples']:,} DCGM samples loaded in {load_['seconds']:.0f} s.",
        "",
        "| what | first call | median of repeats |",
        "|---|---|---|",
        f"| `ampscope devices --prometheus URL --json` (a new process) | "
        f"{m['command_first_s']:.2f} s | {m['command_median_s']:.2f} s |",
    ]
    for name, q in m["queries"].items():
        lines.append(
            f"| query `{name}` alone ({q['samples']:,} samples answered, "
            f"{q['query_bytes']:,} bytes of PromQL) | {q['cold_s']:.2f} s | {q['median_s']:.2f} s |"
        )
    lines += ["", f"Checks: `{json.dumps(m['checks'])}`", ""]
    lines.append(
        f"Load average (1, 5, 15 min) before the measurements: {results['load_average_before']}, "
        f"at the end: {results['load_average_end']}; {os.cpu_count()} CPUs. Figures from a "
        "busy host are upper bounds."
    )
    return "\n".join(lines) + "\n"


def _package_version(package: str) -> str:
    """The Debian package's version (Debian's victoria-metrics 1.79 reports none itself)."""
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.devices_at_scale", description=__doc__)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--repeaters", type=int, default=50)
    parser.add_argument("--run-hours", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--dcgm-interval", type=float, default=3 * 3600.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    path = shutil.which(VICTORIA_METRICS)
    if path is None:
        raise SystemExit("victoria-metrics is not installed (scripts/setup.sh test installs it)")
    now = time.time()
    results: dict[str, Any] = {
        "command": "python -m bench.devices_at_scale " + " ".join(argv or sys.argv[1:]),
        "devices": args.devices,
        "runs": args.runs,
        "repeaters": args.repeaters,
        "run_hours": args.run_hours,
        "interval_s": args.interval,
        "dcgm_interval_s": args.dcgm_interval,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as data,
        victoria_metrics(path, Path(data), "-retentionPeriod=100d") as server,
    ):
        client = VictoriaClient(server.host, server.port)
        results["victoria_metrics"] = client.version() or _package_version(VICTORIA_METRICS)
        results["load"] = load(client, args, now)
        results["load_average_before"] = list(os.getloadavg())
        results["measured"] = measure(client, args)
        client.close()
    results["load_average_end"] = list(os.getloadavg())
    (args.out / "devices-at-scale.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    (args.out / "devices-at-scale.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
