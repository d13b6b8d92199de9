"""Test plumbing shared by the whole suite: real gloo process groups, free ports, tools."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

IN_CI = os.environ.get("CI") == "true"

DEADLOCK_GUARD_S = 30.0
"""How long a test waits for something that must happen (a delivery, a process serving, a
thread ending): only a hang gets there, so no verdict depends on the machine's speed. Waits
that check something does NOT happen may be short: a slower machine only makes them pass."""


def interruptible(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``argv`` as a terminal's foreground job is started: Ctrl-C (SIGINT) reaches it as
    a KeyboardInterrupt, even when this test process inherited SIGINT ignored, as a job that a
    non-interactive shell starts with ``&`` does. An ignored signal stays ignored across exec
    and Python then installs no KeyboardInterrupt; a handled one is reset to its default. So
    SIGINT is handled here while the child is started (tests run in the main thread)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, text=True, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def need_tool(name: str) -> str:
    """Path of an external program; skips the test without it, but fails under CI=true."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (scripts/setup.sh test installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def need_module(name: str) -> None:
    """Import check for an optional library (an extra such as ``ampscope[lightning]``):
    skips the calling test module without it, but fails under CI=true, where
    ``scripts/setup.sh test`` installs every extra."""
    if importlib.util.find_spec(name) is not None:
        return
    message = f"{name} is not installed (scripts/setup.sh test installs it)"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLOCK_GUARD_S) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``timeout``
    seconds, a deadlock guard: the poll interval decides nothing."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.02)


def get_json(url: str, timeout: float = DEADLOCK_GUARD_S) -> Any:
    """GET ``url`` and decode its JSON answer."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def wait_for_http(url: str, what: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until ``url`` answers 200; fails the test when ``process`` (serving it) exits
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{what} did not answer {url} within {timeout:.0f}s")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s: a server a test started never outlives it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def rules_evaluated_after(prometheus_url: str, when: float) -> bool:
    """Whether every rule group of the Prometheus at ``prometheus_url`` was last evaluated
    after ``when`` (Unix time): what a sample scraped at ``when`` implies for the alerts is
    then visible. Wait for it instead of sleeping an evaluation interval."""
    groups = get_json(f"{prometheus_url}/api/v1/rules")["data"]["groups"]
    return bool(groups) and all(
        datetime.fromisoformat(group["lastEvaluation"].replace("Z", "+00:00")).timestamp() > when
        for group in groups
    )


def start_prometheus(
    config: dict[str, Any], workdir: Path, timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """A real Prometheus with ``config`` on a free loopback port, its config, data and log
    under ``workdir``; returns ``(process, url)`` once it is ready. Stop it with
    :func:`stop_process`."""
    prometheus_bin = need_tool("prometheus")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'prometheus-data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=(workdir / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_http(f"{url}/-/ready", "prometheus", process, timeout)
    except BaseException:
        stop_process(process)
        raise
    return process, url


def promtool_check_metrics(text: str) -> str:
    """Fail the test unless ``promtool check metrics`` accepts the exposition ``text``;
    returns its lint output, stdout and stderr (empty when there is nothing to say)."""
    result = subprocess.run(
        [need_tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return (result.stdout + result.stderr).strip()


def promtool_test_rules(path: Path, tests: dict[str, Any]) -> None:
    """Fail the test unless ``promtool test rules`` passes the unit-test file ``tests``
    (written to ``path``): queries and rules on Prometheus' own engine."""
    import yaml

    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [need_tool("promtool"), "test", "rules", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    backend: str,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` real processes on gloo (or
    ``backend``: ``"nccl"`` for one rank per GPU on a CUDA machine).

    ``fn`` must be a module-level function and its return value picklable. Returns the
    results ordered by rank; any rank's exception fails the calling test with its traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, dict(env or {}), results, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                collected[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"ranks did not finish within {timeout:.0f}s: {exc!r}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        pytest.fail("\n".join(errors))
    return [collected[r] for r in range(world_size)]
