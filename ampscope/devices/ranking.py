"""Devices ranked by the number of runs in which they offended: pure functions over samples."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ampscope.devices.query import Sample

KINDS = ("nonfinite_origin", "transient_fault", "replica_divergence")
"""Offence kinds always listed (0 when none): the exporter's ``OFFENCE_KINDS`` (not imported:
this command loads neither the server stack nor pydantic); another kind a newer exporter
sends is kept."""

RETIRED_KINDS = ("origin_outlier",)
"""Kinds older exporters counted, no longer offences (the exporter's
``RETIRED_OFFENCE_KINDS``): an origin outlier alone cannot tell the device from its batch
(an uneven last batch makes a healthy rank one). Their series, which Prometheus may hold
for its retention, are left out, as the repeat-offender rule leaves them out."""


@dataclass
class Device:
    """One device and what it did across the runs Prometheus holds."""

    device: str
    node: str
    """The node of its newest offence (by time; without times, of its last run)."""
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
    nodes: list[str] = field(default_factory=list)
    """Every node label it offended under, sorted: on Kubernetes without ``AMPSCOPE_NODE``
    the node label is the pod's name, new in every run, while the GPU stays one device."""
    hostname: str | None = None
    """The host DCGM-exporter names for its UUID (``Hostname``, or ``hostname`` on its main
    branch: on Kubernetes the node's name), where DCGM-exporter reports it."""

    def as_json(self) -> dict[str, Any]:
        """What ``--json`` lists for it: ``runs`` is a count, ``run_ids`` the runs."""
        return {
            "device": self.device,
            "node": self.node,
            "nodes": self.nodes,
            "hostname": self.hostname,
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
    first (then most offences, newest offence, device).

    Each device is one entry, whatever the node label its offences carry: a GPU's UUID names
    it anywhere, so the runs of a GPU whose pod (the node label on Kubernetes without
    ``AMPSCOPE_NODE``) or node label changed are counted together; a device without a UUID
    is named ``<node>:<local_rank>``, which holds its node already.

    ``min_runs``: a device that offended in at least this many runs is ``flagged``. Samples
    of ``RETIRED_KINDS`` count for nothing: neither a run nor an offence.
    """
    devices: dict[str, Device] = {}
    nodes_of_run: dict[str, dict[str, str]] = {}
    for sample in offences:
        labels, count = sample.labels, round(sample.value)
        if count <= 0 or labels["kind"] in RETIRED_KINDS:
            continue
        name = labels["device"]
        device = devices.setdefault(name, Device(name, labels["node"]))
        if labels["run"] not in device.runs:
            device.runs.append(labels["run"])
        if labels["node"] not in device.nodes:
            device.nodes.append(labels["node"])
        nodes_of_run.setdefault(name, {})[labels["run"]] = labels["node"]
        kind = labels["kind"]
        device.offences[kind] = device.offences.get(kind, 0) + count
    times: dict[str, dict[str, tuple[float, str]]] = {}
    for sample in last:
        labels = sample.labels
        held = times.setdefault(labels["device"], {})
        newest = held.get(labels["run"])
        if newest is None or sample.value >= newest[0]:
            held[labels["run"]] = (sample.value, labels["node"])
    for name, device in devices.items():
        device.runs.sort()
        device.nodes.sort()
        device.flagged = len(device.runs) >= min_runs
        known = {run: t for run, t in times.get(name, {}).items() if run in device.runs}
        if known:
            device.last_run = max(known, key=lambda run: (known[run][0], run))
            device.last_time, device.node = known[device.last_run]
        else:
            device.last_run = device.runs[-1]
            device.node = nodes_of_run[name][device.last_run]
    return sorted(
        devices.values(),
        key=lambda d: (-len(d.runs), -sum(d.offences.values()), -(d.last_time or 0), d.device),
    )


UUID_LABELS = ("UUID", "uuid")
"""DCGM-exporter's GPU UUID label: ``UUID``, or ``uuid`` under ``--use-old-namespace``."""
HOST_LABELS = ("Hostname", "hostname")
"""DCGM-exporter's host label: ``Hostname`` in its releases, ``hostname`` on its main
branch; on Kubernetes it holds the node's name (``NODE_NAME``, from ``spec.nodeName``)."""


def _first(labels: dict[str, str], names: tuple[str, ...]) -> str | None:
    return next((labels[name] for name in names if labels.get(name)), None)


def add_dcgm(devices: Iterable[Device], samples: Iterable[Sample]) -> list[Sample]:
    """Put the non-zero DCGM fields (samples of ``dcgm_query``) on the devices whose name is
    their UUID (``UUID``, or ``uuid`` from an exporter run with ``--use-old-namespace``; a
    GPU's ``GPU-…``, which ``<node>:<local_rank>`` never matches), and the host DCGM-exporter
    names (``Hostname`` or ``hostname``).

    Returns:
        The samples left out because they name no UUID at all, for the caller to warn of:
        one such exporter never hides the fleet's other GPUs.
    """
    by_uuid: dict[str, dict[str, float]] = {}
    hosts: dict[str, str] = {}
    unnamed = []
    for sample in samples:
        uuid = _first(sample.labels, UUID_LABELS)
        if uuid is None:
            unnamed.append(sample)
            continue
        host = _first(sample.labels, HOST_LABELS)
        if host is not None:
            hosts[uuid] = host
        if sample.value:
            by_uuid.setdefault(uuid, {})[sample.labels["field"]] = sample.value
    for device in devices:
        device.dcgm = dict(sorted(by_uuid.get(device.device, {}).items()))
        device.hostname = hosts.get(device.device)
    return unnamed
