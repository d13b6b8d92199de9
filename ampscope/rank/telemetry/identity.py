"""Who a rank is: run id, node, rank, local rank, world size and job id for every record,
and which device it runs on (once per run)."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid

import torch
import torch.distributed as dist

from ampscope.rank.config import LABEL_CHARS
from ampscope.reporter.schema import MAX_LABEL_LENGTH, DeviceIdentity, Identity

logger = logging.getLogger("ampscope")

# torchrun sets TORCHELASTIC_RUN_ID to "none" unless --rdzv-id/--standalone gives one: it
# then says nothing about the run, so ampscope generates an id instead.
_UNSET_ELASTIC_RUN_ID = "none"
_NOT_LABEL_CHARS = re.compile(rf"[^{LABEL_CHARS}]")


def sanitize_label(value: str, fallback: str = "unknown") -> str:
    """``value`` made a valid schema label: other characters become ``_``, cut to length."""
    cleaned = _NOT_LABEL_CHARS.sub("_", value.strip())[:MAX_LABEL_LENGTH]
    return cleaned or fallback


def sanitize_run_id(value: str) -> str:
    """``value`` made a valid schema run id: a label whose ``/`` become ``_`` and that does
    not start with ``.`` (see ``RUN_ID_PATTERN``), so the exporter's API can address it."""
    cleaned = sanitize_label(value).replace("/", "_")
    return "_" + cleaned[1:] if cleaned.startswith(".") else cleaned


def _generated_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for a collective on ``group`` (default: the world):
    the CPU for gloo, else the current CUDA device."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _shared_generated_run_id() -> str:
    """A fresh id from rank 0, broadcast to all ranks of the default group (a collective).

    A fixed-size byte tensor rather than ``broadcast_object_list``, which needs NumPy
    and pickles. Rank 0 broadcasts even when making the id fails (zeros, then): every
    rank then raises ``ValueError`` after the same collective, and none waits alone.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return _generated_run_id()
    buffer = torch.zeros(MAX_LABEL_LENGTH, dtype=torch.uint8, device=collective_device())
    if dist.get_rank() == 0:
        try:
            encoded = sanitize_label(_generated_run_id()).encode("ascii")
            buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        except Exception:
            logger.warning("ampscope: could not make a run id to broadcast", exc_info=True)
            buffer.zero_()
    dist.broadcast(buffer, src=0)
    run_id = bytes(b for b in buffer.tolist() if b).decode("ascii")
    if not run_id:
        raise ValueError("rank 0 broadcast no run id")
    return run_id


def resolve_run_id(explicit: str | None = None, *, collective: bool = True) -> str:
    """The run id: ``explicit``, else ``AMPSCOPE_RUN_ID``, else ``TORCHELASTIC_RUN_ID``, else
    generated on rank 0 and broadcast.

    The broadcast is a collective over the default process group: call this at a point
    every rank reaches in lockstep (the scalers do it in their first ``update()``).
    ``collective=False`` generates a local id instead.
    """
    if explicit:
        return sanitize_run_id(explicit)
    for variable in ("AMPSCOPE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(variable, "").strip()
        if value and value != _UNSET_ELASTIC_RUN_ID:
            return sanitize_run_id(value)
    return sanitize_run_id(_shared_generated_run_id() if collective else _generated_run_id())


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def resolve_node() -> str:
    """The node label: ``AMPSCOPE_NODE`` if set, else the host name.

    The override exists for hosts whose name says nothing about the machine: a Kubernetes pod
    (its host name is the pod's name; pass ``spec.nodeName`` through the downward API), or
    several "nodes" sharing one host in a test.
    """
    override = os.environ.get("AMPSCOPE_NODE", "").strip()
    return sanitize_label(override or socket.gethostname(), fallback="localhost")


JOB_ID_VARIABLES = (
    "AMPSCOPE_JOB_ID",
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "TORCHELASTIC_RUN_ID",
)
"""Where the job id comes from, first set wins: an explicit ``AMPSCOPE_JOB_ID`` (on
Kubernetes, the Job's or pod's name through the downward API), then the batch schedulers'
own (Slurm, PBS/Torque, LSF), then torchrun's rendezvous id (``none`` counts as unset)."""


def resolve_job_id() -> str | None:
    """The scheduler's job id made a label (see ``JOB_ID_VARIABLES``), or ``None``."""
    for variable in JOB_ID_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value and value != _UNSET_ELASTIC_RUN_ID:
            return sanitize_label(value)
    return None


def resolve_identity(explicit_run_id: str | None = None, *, collective: bool = True) -> Identity:
    """This rank's identity; may run one collective (see :func:`resolve_run_id`)."""
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return Identity(
        run=resolve_run_id(explicit_run_id, collective=collective),
        node=resolve_node(),
        rank=rank,
        local_rank=_env_int("LOCAL_RANK", 0),
        world_size=max(world_size, 1),
        local_world_size=max(_env_int("LOCAL_WORLD_SIZE", 0), 0) or None,
        job_id=resolve_job_id(),
    )


def gpu_uuid(raw: object) -> str | None:
    """A CUDA UUID as NVML and DCGM-exporter write it: ``GPU-`` and 8-4-4-4-12 lower-case
    hex digits. ``raw``: torch's ``_CUuuid`` (its ``bytes``), 16 bytes, or a string with or
    without the prefix (a ``MIG-…`` one is kept as it is); ``None`` when it is none of these
    or all zeros (a driver that did not say)."""
    data = getattr(raw, "bytes", raw)
    if isinstance(data, list | tuple):
        data = bytes(data) if all(isinstance(b, int) and 0 <= b < 256 for b in data) else None
    if isinstance(data, bytes | bytearray):
        if len(data) != 16 or not any(data):
            return None
        text = data.hex()
    elif isinstance(raw, str) and raw.strip():
        text = raw.strip()
        if text.startswith(("GPU-", "MIG-")):
            return sanitize_label(text)
        text = text.replace("-", "").lower()
        if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
            return None
    else:
        return None
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def pci_bus_id(domain: object, bus: object, device: object) -> str | None:
    """The PCI address as NVML and DCGM-exporter write it (``00000000:3B:00.0``), or
    ``None`` when a part is not a non-negative integer."""
    parts = (domain, bus, device)
    if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts):
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _nvml_pci_bus_id(uuid: str) -> str | None:
    """The PCI address of the GPU ``uuid`` from nvidia-ml-py, when it is installed (torch
    before 2.6 has no PCI address in its device properties). Never raises."""
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py: optional

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, no driver, an old library: the address stays unknown
        return None
    text = bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else str(bus_id)
    return sanitize_label(text) if text.strip() else None


def _cuda_index(devices: tuple[str, ...]) -> int | None:
    """The index of the first CUDA device among the gradients' devices (``cuda:1``)."""
    for name in devices:
        kind, _, index = name.partition(":")
        if kind == "cuda":
            return int(index) if index.isdigit() else 0
    return None


NODE_NAME_ENV = "NODE_NAME"
"""Where Kubernetes' Downward API puts the node's name (``fieldRef: spec.nodeName``), as
dcgm-exporter's DaemonSet sets it: dcgm-exporter writes it as its host label, so a rank
reads it too (a pod's own host name is the pod's name)."""


def resolve_hostname() -> str:
    """The host DCGM-exporter names: ``NODE_NAME`` where the Downward API sets it (on
    Kubernetes), else the machine's host name. Whatever ``AMPSCOPE_NODE`` says."""
    node_name = os.environ.get(NODE_NAME_ENV, "").strip()
    return sanitize_label(node_name or socket.gethostname(), fallback="localhost")


def resolve_device(identity: Identity, devices: tuple[str, ...]) -> DeviceIdentity:
    """The device of a rank whose gradients live on ``devices`` (``("cuda:0",)``): the
    first CUDA one's UUID and PCI address from torch's device properties, from nvidia-ml-py
    for what torch lacks; without a CUDA device, ``<node>:<local_rank>``.

    Cost: one ``torch.cuda.get_device_properties`` (no sync, no collective), once per run
    on the telemetry thread. Never raises: a GPU that says nothing is named by its node and
    local rank.
    """
    hostname = resolve_hostname()
    fallback = DeviceIdentity(
        device=sanitize_label(f"{identity.node}:{identity.local_rank}"), hostname=hostname
    )
    index = _cuda_index(devices)
    if index is None:
        return fallback
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception:  # a CUDA device that torch cannot describe: named by its slot
        return fallback
    uuid = gpu_uuid(getattr(props, "uuid", None))
    if uuid is None:
        return fallback
    bus = pci_bus_id(
        getattr(props, "pci_domain_id", None),
        getattr(props, "pci_bus_id", None),
        getattr(props, "pci_device_id", None),
    )
    return DeviceIdentity(device=uuid, pci_bus_id=bus or _nvml_pci_bus_id(uuid), hostname=hostname)
