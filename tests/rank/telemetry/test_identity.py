"""Run id precedence, label sanitising and the device a rank names (the collective path runs
in test_distributed; the CUDA path needs a GPU)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

import pytest
import torch

from ampscope.rank.telemetry.identity import (
    JOB_ID_VARIABLES,
    gpu_uuid,
    pci_bus_id,
    resolve_device,
    resolve_identity,
    resolve_job_id,
    resolve_run_id,
    sanitize_label,
)


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPSCOPE_RUN_ID", "from ampscope")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert resolve_run_id("explicit") == "explicit"
    assert resolve_run_id() == "from_ampscope"
    monkeypatch.delenv("AMPSCOPE_RUN_ID")
    assert resolve_run_id() == "elastic-7"
    # torchrun's placeholder says nothing about the run: generate one instead.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    generated = resolve_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", generated)


def test_identity_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_identity("r1").local_world_size is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    identity = resolve_identity("r1")
    assert identity.local_world_size == 4
    assert (identity.run, identity.rank, identity.world_size, identity.local_rank) == (
        "r1",
        3,
        8,
        1,
    )
    assert identity.node


def test_job_id_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in JOB_ID_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert resolve_job_id() is None
    assert resolve_identity("r1").job_id is None
    # torchrun's placeholder is no id; a real rendezvous id is the last resort.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert resolve_job_id() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-9")
    assert resolve_job_id() == "rdzv-9"
    monkeypatch.setenv("LSB_JOBID", "lsf-1")
    assert resolve_job_id() == "lsf-1"
    monkeypatch.setenv("PBS_JOBID", "77.pbs server")
    assert resolve_job_id() == "77.pbs_server"
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert resolve_job_id() == "123456"
    # Kubernetes: the Job's name through the downward API, sanitised like every label.
    monkeypatch.setenv("AMPSCOPE_JOB_ID", ' train-llama "7b" ')
    assert resolve_job_id() == "train-llama__7b_"
    assert resolve_identity("r1").job_id == "train-llama__7b_"


def test_sanitize() -> None:
    assert sanitize_label(' a"b c\n') == "a_b_c"
    assert sanitize_label("") == "unknown"
    assert len(sanitize_label("x" * 500)) == 128


def test_run_ids_become_single_path_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    # The exporter refuses run ids with "/" or a leading "." (the JSON API could not
    # address them); the rank side maps them to ones it accepts.
    monkeypatch.setenv("AMPSCOPE_RUN_ID", "team/exp.1")
    assert resolve_run_id() == "team_exp.1"
    assert resolve_run_id("..") == "_."
    assert resolve_run_id(".hidden") == "_hidden"
    assert resolve_identity("a/b", collective=False).run == "a_b"


def test_node_is_the_host_name_unless_ampscope_node_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AMPSCOPE_NODE", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-host-7")
    assert resolve_identity("r1").node == "gpu-host-7"
    monkeypatch.setenv("AMPSCOPE_NODE", "ip-10-0-3-17.ec2.internal")
    assert resolve_identity("r1").node == "ip-10-0-3-17.ec2.internal"
    # Blank means unset; an odd value is made a label like every other identity string.
    monkeypatch.setenv("AMPSCOPE_NODE", "  ")
    assert resolve_identity("r1").node == "gpu-host-7"
    monkeypatch.setenv("AMPSCOPE_NODE", "node 1")
    assert resolve_identity("r1").node == "node_1"


def test_a_rank_without_a_gpu_is_named_by_its_node_and_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AMPSCOPE_NODE", "n1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(socket, "gethostname", lambda: "host 7")
    monkeypatch.delenv("NODE_NAME", raising=False)
    identity = resolve_identity("r1", collective=False)
    device = resolve_device(identity, ("cpu",))
    assert (device.device, device.pci_bus_id, device.hostname) == ("n1:3", None, "host_7")
    # No device at all (a rank whose model has no gradients yet): the same.
    assert resolve_device(identity, ()).device == "n1:3"


def test_the_hostname_is_the_node_name_the_downward_api_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Kubernetes a pod's host name is the pod's; dcgm-exporter labels its series with
    NODE_NAME (spec.nodeName through the Downward API), and so does the rank's hostname."""
    monkeypatch.setattr(socket, "gethostname", lambda: "train-r1-worker-0")
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.delenv("AMPSCOPE_NODE", raising=False)
    identity = resolve_identity("r1", collective=False)
    assert resolve_device(identity, ("cpu",)).hostname == "gpu-node-7"
    assert identity.node == "train-r1-worker-0"  # the node label: AMPSCOPE_NODE's to set
    monkeypatch.setenv("NODE_NAME", " ")  # blank: unset
    assert resolve_device(identity, ("cpu",)).hostname == "train-r1-worker-0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to name")
def test_cuda_gradients_that_torch_cannot_describe_name_the_slot() -> None:
    identity = resolve_identity("r1", collective=False)
    node = identity.node
    assert resolve_device(identity, ("cuda:0",)).device == f"{node}:{identity.local_rank}"


def test_gpu_uuids_are_written_as_nvml_and_dcgm_write_them() -> None:
    raw = bytes(range(0x10, 0x20))
    expected = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
    assert gpu_uuid(raw) == expected
    assert gpu_uuid(list(raw)) == expected  # torch's _CUuuid.bytes is a list of ints
    assert gpu_uuid("10111213-1415-1617-1819-1A1B1C1D1E1F") == expected
    assert gpu_uuid(expected) == expected
    assert gpu_uuid("MIG-7a2b-x") == "MIG-7a2b-x"
    assert gpu_uuid(bytes(16)) is None  # all zeros: the driver did not say
    assert gpu_uuid(b"short") is None
    assert gpu_uuid("not-a-uuid") is None
    assert gpu_uuid(None) is None


def test_pci_addresses_are_written_as_nvml_writes_them() -> None:
    assert pci_bus_id(0, 0x3B, 0) == "00000000:3B:00.0"
    assert pci_bus_id(1, 0xCA, 0x1F) == "00000001:CA:1F.0"
    assert pci_bus_id(0, None, 0) is None
    assert pci_bus_id(0, -1, 0) is None
    assert pci_bus_id(0, True, 0) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_rank_is_named_by_the_uuid_nvidia_smi_reports() -> None:
    identity = resolve_identity("r1", collective=False)
    device = resolve_device(identity, ("cpu", "cuda:0"))
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", device.device)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    listed = subprocess.run(
        [smi, "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = (line.split(",") for line in listed.splitlines())
    gpus = {uuid.strip(): bus.strip() for uuid, bus in rows}
    assert device.device in gpus, (device, gpus)
    if device.pci_bus_id is not None:
        assert device.pci_bus_id == gpus[device.device]
