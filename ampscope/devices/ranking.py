"""Devices ranked by the number of runs in which they offended: pure functions over samples."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ampscope.devices.query import Sample

KINDS = ("nonfinite_origin", "origin_outlier", "transient_fault", "replica_divergence")
"""Offence kinds always listed (0 when none): the exporter's ``OFFENCE_KINDS`` (not imported:
this command loads neither the server stack nor pydantic); another kind a newer exporter
sends is kept."""


@dataclass
class Device:
    """One device and what it did across the runs Prometheus holds."""

    device: str
    node: str
    runs: list[str] = field(default_factory=list)
    """The runs in which it offended, sorted."""
    offences: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    """Offences by kind, summed over those runs."""
    last_run: str | None = None
    """The run of its newest offence (by time; without times, the last run id)."""
    last_time: float | None = None
    """Unix time of its newest offence; ``None`` where no exporter said."""
    dcgm: dict[str, float] = field(default_factory=dict)
    """DCGM-exporter error fields of its UUID that are not zero."""
    flagged: bool = False
    """It offended in at least the threshold's number of runs."""

    def as_json(self) -> dict[str, Any]:
        """What ``--json`` lists for it: ``runs`` is a count, ``run_ids`` the runs."""
        return {
            "device": self.device,
            "node": self.node,
            "runs": len(self.runs),
            "run_ids": self.runs,
            "offences": self.offences,
            "last_run": self.last_run,
            "last_offence_time": self.last_time,
            "dcgm": self.dcgm,
            "flagged": self.flagged,
        }


def rank(offences: Iterable[Sample], last: Iterable[Sample], min_runs: int) -> list[Device]:
    """Devices from the samples of ``offences_query`` and ``last_offence_query``, most runs
    first (then most offences, newest offence, device). Each (device, node) is one entry: a
    GPU's UUID names it anywhere, ``<node>:<local_rank>`` only on its node.

    ``min_runs``: a device that offended in at least this many runs is ``flagged``.
    """
    devices: dict[tuple[str, str], Device] = {}
    for sample in offences:
        labels, count = sample.labels, round(sample.value)
        if count <= 0:
            continue
        key = (labels["device"], labels["node"])
        device = devices.setdefault(key, Device(*key))
        if labels["run"] not in device.runs:
            device.runs.append(labels["run"])
        kind = labels["kind"]
        device.offences[kind] = device.offences.get(kind, 0) + count
    times: dict[tuple[str, str], dict[str, float]] = {}
    for sample in last:
        labels = sample.labels
        times.setdefault((labels["device"], labels["node"]), {})[labels["run"]] = sample.value
    for key, device in devices.items():
        device.runs.sort()
        device.flagged = len(device.runs) >= min_runs
        known = {run: t for run, t in times.get(key, {}).items() if run in device.runs}
        if known:
            device.last_run = max(known, key=lambda run: (known[run], run))
            device.last_time = known[device.last_run]
        else:
            device.last_run = device.runs[-1]
    return sorted(
        devices.values(),
        key=lambda d: (-len(d.runs), -sum(d.offences.values()), -(d.last_time or 0), d.device),
    )


def add_dcgm(devices: Iterable[Device], samples: Iterable[Sample]) -> None:
    """Put the non-zero DCGM fields (samples of ``dcgm_query``) on the devices whose name is
    their ``UUID`` (a GPU's ``GPU-…``; ``<node>:<local_rank>`` never matches)."""
    by_uuid: dict[str, dict[str, float]] = {}
    for sample in samples:
        if sample.value:
            fields = by_uuid.setdefault(sample.labels["UUID"], {})
            fields[sample.labels["field"]] = sample.value
    for device in devices:
        device.dcgm = dict(sorted(by_uuid.get(device.device, {}).items()))
