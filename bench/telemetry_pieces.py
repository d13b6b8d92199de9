"""Where the telemetry thread's instructions go, piece by piece, counted by callgrind.

The loops of :mod:`bench.tensor_growth` queue ``--records`` steps with the telemetry thread
held off; each piece of its work then runs for all of them on this thread, between a
zero and a dump of callgrind's counters (``callgrind_control``), so that each dump holds
one piece. Pieces that keep state (the spike windows, the fault rule) run on copies, and
the full build runs last on the real builder, so every piece sees the state it would::

    valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        --callgrind-out-file=/tmp/cg/pieces.out \\
        python -m bench.telemetry_pieces scaler 148 --records 30
    python -m bench.telemetry_pieces --report /tmp/cg/pieces.out --records 30

The report gives instructions per record of each dump, less the ``empty`` one (what
the zero and the dump themselves cost): ``read`` (the pending step's lay-out and host
values), ``decode``, ``stats`` and ``faults`` (each with a decode, subtracted), ``build``
(the whole record: decode, checks, stats, fault rule and the record's models),
``deliver`` (history, outbox, the counting sink) and ``free`` (dropping the pending steps:
their tensors and lists). What the thread adds on top (waking up, its locks) is the
difference to ``tensor_growth --instructions``'s per-record count.

It also runs against the package before the stats' host scalars were read once
(commit d63dbf3), for the "before" column of docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import subprocess
from pathlib import Path
from typing import Any


def _ctl(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def _phase(name: str, work: Any) -> None:
    _ctl("-z")
    work()
    _ctl("-d", name)


def measure(setup: str, size: int, records: int) -> None:
    import torch

    from ampscope.rank.capture import layout
    from ampscope.rank.telemetry import pipeline
    from ampscope.reporter.fault_rule import Iteration
    from bench.tensor_growth import Contender, _one_rank_group

    pipeline.Telemetry._run = lambda self: None  # type: ignore[method-assign]
    torch.set_num_threads(1)
    with _one_rank_group():
        contender = Contender(setup, size, True)
        telemetry = contender.front._ampscope_telemetry
        for _ in range(25):  # warm-up: the spike windows hold 20 values and more
            contender.iteration()
        telemetry._resolve()
        telemetry._deliver()
        for _ in range(records):
            contender.iteration()
        pending = list(telemetry._pending)
        builder = telemetry._builder
        values: list[list[float]] = []
        built: list[Any] = []

        def decode(p: Any, v: list[float]) -> Any:
            return layout.decode(v, p.optimizers, p.local_devices, p.origin_devices)

        stats = copy.deepcopy(builder.stats)

        def run_stats() -> None:
            for p, v in zip(pending, values, strict=True):
                if p.stats is None:
                    continue
                d = decode(p, v)
                scale = 1.0 if p.setup.mode == "watch" else d.scale_before
                on_host = p.values is not None
                if hasattr(stats, "host_scalars"):
                    scalars = stats.host_scalars(p.stats, v, d.stats_at, on_host=on_host)
                    stats.build(
                        p.stats, scalars, overflow=False, scale=scale, host_norms=p.host_norms
                    )
                else:  # the package before d63dbf3's successor
                    stats.build(
                        p.stats,
                        v,
                        d.stats_at,
                        overflow=False,
                        scale=scale,
                        host_norms=p.host_norms,
                        on_host=on_host,
                    )

        faults = copy.deepcopy(builder.faults)

        def run_faults() -> None:
            for p, v in zip(pending, values, strict=True):
                d = decode(p, v)
                faults.observe(
                    Iteration(
                        scaler=p.setup.mode != "watch",
                        nonfinite=False,
                        own=None,
                        scale_before=d.scale_before,
                        scale_after=d.scale_after,
                        growth_tracker=d.growth_tracker,
                        grew=d.growth_tracker == 0,
                        manual=False,
                        after_applied=False,
                        applied=False,
                    )
                )

        def deliver() -> None:
            for record in built:
                telemetry._last = record
                telemetry._history.append(record)
                telemetry._queue_for_sinks(record)
            telemetry._deliver()

        def free() -> None:
            telemetry._pending.clear()
            pending.clear()
            values.clear()

        _ctl("-i", "on")
        _phase("empty", lambda: None)
        _phase("read", lambda: values.extend(p.read() for p in pending))
        _phase("decode", lambda: [decode(p, v) for p, v in zip(pending, values, strict=True)])
        _phase("decode+stats", run_stats)
        _phase("decode+faults", run_faults)
        _phase(
            "build",
            lambda: built.extend(builder.build(p, v) for p, v in zip(pending, values, strict=True)),
        )
        _phase("deliver", deliver)
        _phase("free", free)
        _ctl("-i", "off")
        contender.close()


def report(out: str, records: int) -> dict[str, int]:
    """Instructions per record of each piece, from the dumps of ``out`` (thread 1)."""
    dumps: dict[str, int] = {}
    for path in sorted(glob.glob(f"{out}.*-01"), key=lambda p: int(p.split(".")[-1][:-3])):
        lines = Path(path).read_text().splitlines()
        name = next(line.rsplit(" ", 1)[-1] for line in lines if line.startswith("desc: Trigger"))
        dumps[name] = next(int(line.split()[1]) for line in lines if line.startswith("totals:"))
    empty = dumps["empty"]

    def per(name: str) -> int:
        return round((dumps[name] - empty) / records)

    pieces = {
        "read": per("read"),
        "decode": per("decode"),
        "stats": per("decode+stats") - per("decode"),
        "faults": per("decode+faults") - per("decode"),
        "build": per("build"),
        "deliver": per("deliver"),
        "free": per("free"),
    }
    pieces["rest of build"] = (
        pieces["build"] - pieces["decode"] - pieces["stats"] - pieces["faults"]
    )
    return pieces


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry_pieces", description=__doc__)
    parser.add_argument("setup", nargs="?", default="scaler")
    parser.add_argument("size", nargs="?", type=int, default=148)
    parser.add_argument("--records", type=int, default=30)
    parser.add_argument("--report", metavar="CALLGRIND_OUT")
    args = parser.parse_args(argv)
    if args.report:
        for name, count in report(args.report, args.records).items():
            print(f"{name:14s} {count:9,d}")
        return
    measure(args.setup, args.size, args.records)


if __name__ == "__main__":
    main()
