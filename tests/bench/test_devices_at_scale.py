"""``python -m bench.devices_at_scale`` on a small fleet: a smoke test of the harness, not a
timed assertion. The command must list every device, the planted repeat offenders first, and
find the planted XID errors through DCGM-exporter's series."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import need_tool

REPO = Path(__file__).resolve().parents[2]


def test_every_device_is_listed_and_the_repeat_offenders_first(tmp_path: Path) -> None:
    need_tool("victoria-metrics")
    subprocess.run(
        [
            *(sys.executable, "-m", "bench.devices_at_scale", "--devices", "80", "--runs", "8"),
            *("--repeaters", "4", "--repeats", "1", "--out", str(tmp_path)),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=600,
    )
    results = json.loads((tmp_path / "devices-at-scale.json").read_text())
    checks = results["measured"]["checks"]
    assert checks == {
        "exit_status": 1,
        "devices_listed": 80,
        "every_device_listed": True,
        "repeaters_first": True,
        "repeater_runs": [2, 3],
        "repeaters_in_enough_runs": True,
        "xid_found": 10,
    }
    assert set(results["measured"]["queries"]) == {"offences", "last_offence", "dcgm"}
    assert (tmp_path / "devices-at-scale.md").read_text().startswith("# `ampscope devices`")
