"""bench.telemetry_pieces' report: per-record instructions of each piece from callgrind's
dumps, the dump of nothing (the zero and dump themselves) taken off."""

from __future__ import annotations

from pathlib import Path

from bench.telemetry_pieces import report

DUMPS = {  # name: totals of thread 1 over 10 records
    "empty": 1_000,
    "read": 21_000,
    "decode": 11_000,
    "decode+stats": 41_000,
    "decode+faults": 16_000,
    "build": 101_000,
    "deliver": 2_000,
    "free": 4_000,
}


def test_the_report_gives_each_piece_per_record(tmp_path: Path) -> None:
    out = tmp_path / "pieces.out"
    for number, (name, total) in enumerate(DUMPS.items(), start=1):
        # callgrind_control -d NAME writes OUT.<n>-01 for thread 1, as here.
        (tmp_path / f"pieces.out.{number}-01").write_text(
            f"version: 1\ndesc: Trigger: dump {name}\nevents: Ir\ntotals: {total}\n"
        )
        (tmp_path / f"pieces.out.{number}-02").write_text(f"desc: Trigger: dump {name}\n")
    pieces = report(str(out), records=10)
    assert pieces == {
        "read": 2_000,
        "decode": 1_000,
        "stats": 3_000,  # decode+stats less decode
        "faults": 500,
        "build": 10_000,
        "deliver": 100,
        "free": 300,
        "rest of build": 10_000 - 1_000 - 3_000 - 500,
    }
