"""Run id precedence and label sanitising (the collective path runs in test_distributed)."""

from __future__ import annotations

import re
import socket

import pytest

from ampscope.rank.telemetry.identity import (
    JOB_ID_VARIABLES,
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
