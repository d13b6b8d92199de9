"""``python -m bench``: measure ampscope's cost and write JSON results plus a Markdown summary.

Writes ``<out>/<mode>.json`` and ``<out>/<mode>.md`` (``<mode>-cuda.*`` with
``--device cuda``). Load runs only against loopback servers this command starts itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.config import preset
from bench.exporter import run_exporter_bench
from bench.machine import machine_info
from bench.report import render_markdown
from bench.servers import pushgateway_path

SECTIONS = ("scaler", "exporter")
RESULTS_VERSION = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--mode",
        choices=("quick", "full"),
        default="quick",
        help="quick: CI smoke run (< 1 min); full: the published figures (~10 min)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of the scaler section (cuda: fp16 autocast, world size 1 on NCCL)",
    )
    parser.add_argument(
        "--only", choices=SECTIONS, action="append", help="run only this section (repeatable)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return parser


def _gpu_status(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        return {"status": "run", "name": torch.cuda.get_device_name(0)}
    reason = "no CUDA device" if not torch.cuda.is_available() else "run with --device cuda"
    return {"status": f"not run ({reason})"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the chosen sections and return the results document."""
    config = preset(args.mode)
    sections = args.only or list(SECTIONS)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device available")
    pushgateway = pushgateway_path()
    started = time.monotonic()
    results: dict[str, Any] = {
        "results_version": RESULTS_VERSION,
        "mode": args.mode,
        "command": shlex.join(["python", "-m", "bench", *sys.argv[1:]]),
        "machine": machine_info(pushgateway=pushgateway),
        "config": config.as_dict(),
        "gpu": _gpu_status(args.device),
    }
    if "scaler" in sections:
        from bench.scaler_section import run_scaler_bench

        results["scaler"] = run_scaler_bench(config.scaler, device=args.device)
    if "exporter" in sections:
        results["exporter"] = run_exporter_bench(config.exporter, pushgateway_bin=pushgateway)
    results["duration_s"] = time.monotonic() - started
    # Other work on the host shows here: the interleaving cancels drift, not noise.
    results["machine"]["load_average_end"] = list(os.getloadavg())
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers this run started are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.mode + ("-cuda" if args.device == "cuda" else "")
    json_path = args.out / f"{stem}.json"
    md_path = args.out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    md_path.write_text(render_markdown(results))
    print(f"wrote {json_path} and {md_path} in {results['duration_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
