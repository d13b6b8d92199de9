"""``python -m bench.at_scale``: the whole job at 1,024 nodes x 8 ranks, held by VictoriaMetrics.

Loads a :class:`~bench.simulated_job.SimulatedJob` (every node a real exporter core, five
planted faults) into a fresh single-node VictoriaMetrics through its Prometheus import
endpoint, one sample per series every ``--interval`` seconds (the shipped scrape interval),
then measures:

* ``ampscope status --prometheus URL RUN`` and ``... --json``: the wall time of the whole
  command on its first call (a new process: Python start-up and imports included), its exit
  status, and whether it named each planted fault and the missing rank; each of its
  queries alone;
* the series count, and VictoriaMetrics' bytes per series and per sample (disk, once
  flushed) and its resident memory;
* the recording rules evaluated at the last three minutes and written back, as a live
  rule engine would have;
* every recording-rule and alert expression of deploy/prometheus/rules, as an instant query
  at the newest scrape, and every dashboard query (template variables substituted: one run
  chosen, every node and rank) as an instant query and as a Grafana range query over the
  loaded window; the variables' ``label_values`` queries too.

Every query is sent with ``nocache=1`` and timed first (cold) and as the median of
``--repeats`` more. Prints a Markdown summary; writes ``<out>/at-scale.json`` and ``.md``.
Standalone (not part of ``python -m bench``); needs ``victoria-metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from ampscope.status import prometheus
from ampscope.verdicts.thresholds import Thresholds
from bench.machine import machine_info
from bench.servers import VICTORIA_METRICS, victoria_metrics
from bench.simulated_job import SimulatedJob
from bench.victoria import VictoriaClient, load_job

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "ampscope-alerts.yml"
DASHBOARDS = ROOT / "dashboards"
RUN = "pretrain-70b"


def _timed(fn: Callable[[], tuple[float, Any]], repeats: int) -> dict[str, Any]:
    first, result = fn()
    again = [fn()[0] for _ in range(repeats)]
    return {
        "first_ms": first * 1e3,
        "median_ms": statistics.median(again) * 1e3 if again else None,
        "series": len(result),
    }


def _status(url: str, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "status", "--prometheus", url, RUN, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return time.perf_counter() - started, done


def _named(job: SimulatedJob, answer: dict[str, Any]) -> dict[str, bool]:
    """Which planted faults the ``--json`` answer names, with the right rank."""
    verdicts = {v["rule"]: v for v in answer["health"]["verdicts"]}
    faults = job.faults

    def ranks(rule: str, key: str = "ranks") -> list[Any]:
        return list(verdicts[rule]["evidence"].get(key, []))

    top = ranks("inf_hotspot", "top")
    return {
        "hotspot": verdicts["inf_hotspot"]["status"] == "warning"
        and top[0]["rank"] == faults.hotspot,
        "desync": [r["rank"] for r in ranks("scale_desync")] == [faults.desync],
        "lost": [r["rank"] for r in ranks("lost_rank")] == [faults.lost],
        "missing": answer["missing_ranks"] == [faults.missing],
        "loss spike": [r["rank"] for r in ranks("loss_spike")] == [faults.spike],
        "origin outlier": [r["rank"] for r in ranks("origin_outlier")] == [faults.spike],
    }


def measure_status(job: SimulatedJob, client: VictoriaClient, repeats: int) -> dict[str, Any]:
    text_s, text = _status(client.url)
    json_s, as_json = _status(client.url, "--json")
    if as_json.returncode not in (0, 1, 2):
        raise RuntimeError(f"status --json failed: {as_json.stderr}")
    now = time.time()
    queries = {
        name: _timed(partial(client.query, promql, now), repeats)
        for name, promql in prometheus.queries(RUN, Thresholds()).items()
    }
    return {
        "text": {"wall_s": text_s, "exit": text.returncode},
        "json": {"wall_s": json_s, "exit": as_json.returncode},
        "named": _named(job, json.loads(as_json.stdout)),
        "queries": queries,
        "table": text.stdout,
    }


def measure_size(client: VictoriaClient, server_rss: int, samples: int) -> dict[str, Any]:
    now = time.time()
    series = client.series_count('{__name__=~"ampscope_.*"}', now - 3600, now)
    metrics = client.metrics()
    disk = {
        key.split('"')[1]: value
        for key, value in metrics.items()
        if key.startswith("vm_data_size_bytes{")
    }
    data = sum(v for k, v in disk.items() if k.startswith("storage/"))
    index = sum(v for k, v in disk.items() if k.startswith("indexdb"))
    return {
        "series": series,
        "samples": samples,
        "disk_bytes": disk,
        "data_bytes_per_sample": data / samples,
        "index_bytes_per_series": index / series,
        "disk_bytes_per_series": (data + index) / series,
        "rss_bytes": server_rss,
        "rss_bytes_per_series": server_rss / series,
        "tsdb_status": client.tsdb_status(),
    }


def record_rules(client: VictoriaClient, times: list[float]) -> dict[str, Any]:
    """Evaluate the recording rules at each of ``times`` (oldest first), in file order, and
    write each result back with its time, as a rule engine would have done live: the
    alerts and panels that read recorded series then find them. (vmalert's ``-replay``
    cannot serve here: it writes a point only every five minutes against this
    VictoriaMetrics, too sparse for ``last_over_time(...[1m])``.)"""
    recording = [
        rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    ]
    started = time.perf_counter()
    written = 0
    for at in times:
        for rule in recording:
            _, result = client.query(rule["expr"], at)
            lines = []
            for sample in result:
                labels = {**sample["metric"], "__name__": rule["record"]}
                name = labels.pop("__name__")
                inner = ",".join(
                    f'{key}="{_escape(value)}"' for key, value in sorted(labels.items())
                )
                lines.append(f"{name}{{{inner}}} {sample['value'][1]} {int(at * 1000)}\n")
            if lines:
                client.import_prometheus("".join(lines).encode(), {})
                client.flush()
            written += len(lines)
    return {"seconds": time.perf_counter() - started, "evaluations": len(times), "samples": written}


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def template_values(run: str, interval_s: float) -> dict[str, str]:
    """Grafana's variables as a user of one run sees them: ``$__rate_interval`` is four
    scrape intervals, as Grafana computes it; every node and rank selected, and rank 0 for
    the FP8 row (one rank's layers)."""
    return {
        "$__rate_interval": f"{4 * interval_s:g}s",
        "$__interval": f"{interval_s:g}s",
        "$__range": "10m",
        "$run": run,
        "$node": ".*",
        "$rank": ".*",
        "$fp8_rank": "0",
    }


def substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def measure_rules(client: VictoriaClient, at: float, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            rows.append(
                {
                    "group": group["name"],
                    "name": rule.get("record") or rule["alert"],
                    "kind": "record" if "record" in rule else "alert",
                    "expr": expr,
                    **_timed(partial(client.query, expr, at), repeats),
                }
            )
    return rows


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return found


def measure_dashboards(
    client: VictoriaClient, start: float, end: float, interval_s: float, repeats: int
) -> list[dict[str, Any]]:
    values = template_values(RUN, interval_s)
    rows = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            text = query.get("query") if isinstance(query, dict) else None
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text or "")
            if match is None:
                continue
            selector, label = substitute(match.group(1), values), match.group(2)
            rows.append(
                {
                    "dashboard": path.name,
                    "panel": f"variable ${variable['name']}",
                    "expr": text,
                    "instant": _timed(partial(client.label_values, label, selector), 1),
                    "range": None,
                }
            )
        for panel in _panels(dashboard):
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], values)
                rows.append(
                    {
                        "dashboard": path.name,
                        "panel": panel["title"],
                        "expr": target["expr"],
                        "instant": _timed(partial(client.query, expr, end), repeats),
                        "range": _timed(
                            partial(client.query_range, expr, start, end, interval_s), repeats
                        ),
                    }
                )
    return rows


def _ms(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return ""
    median = cell["median_ms"]
    return f"{cell['first_ms']:.0f}" + (f" / {median:.0f}" if median is not None else "")


def _package_version(package: str) -> str:
    """The Debian package's version, for builds whose binary does not say (Debian's
    victoria-metrics 1.79 reports an empty ``vm_app_version``)."""
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
    return f"{out.stdout.strip()} (Debian package)" if out.returncode == 0 else "unknown"


def _loads(machine: dict[str, Any]) -> str:
    start, end = machine["load_average"], machine.get("load_average_end")
    text = "/".join(f"{x:.1f}" for x in start)
    if end:
        text += " at the start, " + "/".join(f"{x:.1f}" for x in end) + " at the end"
    return text


def render_markdown(results: dict[str, Any]) -> str:
    status, size, load = results["status"], results["size"], results["load"]
    lines = [
        f"# ampscope at scale: {results['nodes']} nodes x 8 ranks ({results['ranks']} ranks)",
        "",
        f"`{results['command']}` on {results['machine']['cpu_cores_usable']} CPUs, "
        f"load average {_loads(results['machine'])}; VictoriaMetrics "
        f"{results['victoria_metrics']}.",
        "",
        f"- Loaded {load['samples']:,} samples ({results['scrapes']} scrapes "
        f"{results['interval_s']:g} s apart) in {load['seconds']:.0f} s.",
        f"- Series: {size['series']:,}; disk {size['disk_bytes_per_series']:.0f} bytes per "
        f"series ({size['index_bytes_per_series']:.0f} of them index), "
        f"{size['data_bytes_per_sample']:.2f} bytes per sample; VictoriaMetrics RSS "
        f"{size['rss_bytes'] / 2**20:.0f} MiB ({size['rss_bytes_per_series']:.0f} bytes per "
        "series).",
        f"- `status --prometheus URL RUN`, first call: {status['text']['wall_s']:.2f} s "
        f"(exit {status['text']['exit']}); `--json`: {status['json']['wall_s']:.2f} s; "
        f"named: {', '.join(k for k, v in status['named'].items() if v) or 'nothing'}"
        f"{'' if all(status['named'].values()) else ' (NOT ALL)'}.",
        f"- Recording rules evaluated and written back at "
        f"{results['recorded']['evaluations']} times: {results['recorded']['seconds']:.0f} s.",
        "",
        "Times in ms: first (cold) / median of the repeats; series returned.",
        "",
        "| status query | ms | series |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {_ms(c)} | {c['series']:,} |" for n, c in status["queries"].items()]
    lines += ["", "| rule | kind | ms | series |", "|---|---|---|---|"]
    lines += [
        f"| `{r['name']}` | {r['kind']} | {_ms(r)} | {r['series']:,} |" for r in results["rules"]
    ]
    lines += ["", "| dashboard panel | instant ms | range ms | series |", "|---|---|---|---|"]
    lines += [
        f"| {r['panel']} | {_ms(r['instant'])} | {_ms(r['range'])} | "
        f"{(r['range'] or r['instant'])['series']:,} |"
        for r in results["dashboards"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.at_scale", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1024, help="nodes of 8 ranks")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between scrapes")
    parser.add_argument("--scrapes", type=int, default=56, help="samples per series")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per query")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    path = shutil.which(VICTORIA_METRICS)
    if path is None:
        raise SystemExit("victoria-metrics is not installed (scripts/setup.sh test installs it)")
    job = SimulatedJob(
        run=RUN, nodes=args.nodes, interval_s=args.interval, scrapes_per_series=args.scrapes
    )
    results: dict[str, Any] = {
        "command": "python -m bench.at_scale " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(pushgateway=None),
        "nodes": args.nodes,
        "ranks": job.world_size,
        "interval_s": args.interval,
        "scrapes": args.scrapes,
        "faults": vars(job.faults),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as data, victoria_metrics(path, Path(data)) as server:
        client = VictoriaClient(server.host, server.port)
        results["victoria_metrics"] = client.version() or _package_version(VICTORIA_METRICS)
        results["load"] = load_job(job, client)
        end = results["load"]["newest_scrape"]
        start = end - (args.scrapes - 1) * args.interval
        results["status"] = measure_status(job, client, args.repeats)
        results["size"] = measure_size(client, server.rss_bytes(), results["load"]["samples"])
        # Every minute of the last three, as vmalert's default evaluation interval.
        results["recorded"] = record_rules(client, [end - 120, end - 60, end])
        results["rules"] = measure_rules(client, end, args.repeats)
        results["dashboards"] = measure_dashboards(client, start, end, args.interval, args.repeats)
        client.close()
    # Other work on the host shows here: compare figures within one run.
    results["machine"]["load_average_end"] = list(os.getloadavg())
    (args.out / "at-scale.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    (args.out / "at-scale.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
