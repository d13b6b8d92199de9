"""Test plumbing shared by the whole suite: real gloo process groups, free ports, tools."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
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


def promtool_test_queries(
    path: Path, series: list[dict[str, Any]], exprs: list[dict[str, Any]]
) -> None:
    """:func:`promtool_test_rules` for queries alone: ``exprs`` (``promql_expr_test``
    entries) over ``series`` (``input_series``) scraped every 15 s, no rule file."""
    tests = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": exprs}],
    }
    promtool_test_rules(path, tests)


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
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        outcome = (rank, "ok", fn(rank, world_size, *args))
    except BaseException:
        outcome = (rank, "error", traceback.format_exc())
    # Reported before the process group goes: a failing rank's own error is then on its way
    # before its peers see the connection drop and report theirs.
    results.put(outcome)
    # The outcome is reported; a broken group's teardown adds nothing to it.
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


REPORT_GRACE_S = DEADLOCK_GUARD_S
"""After one rank fails, how long :func:`run_distributed` still waits for the others'
outcomes. A rank blocked in a collective whose peer is gone may never report: it is then
named with "did not report", and the grace bounds the wait."""

_POLL_S = 0.5
"""How often the wait for results looks for a rank that exited without reporting."""


def _exit_status(process: Any) -> str:
    """A rank's process as ``Process.exitcode`` tells it, in words."""
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _collect(
    results: Any, procs: list[Any], timeout: float, grace: float
) -> tuple[dict[int, Any], dict[int, str], list[int]]:
    """Read every rank's outcome from ``results``: ``(values, errors, failure order)``.

    Waits up to ``timeout`` seconds for each next outcome, as long as no rank has failed;
    from the first failure (a reported error, or a rank that exited without reporting) on,
    the others get ``grace`` seconds in all. A rank with no outcome is absent from both
    dictionaries."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    order: list[int] = []
    pending = set(range(len(procs)))
    next_deadline = time.monotonic() + timeout
    grace_deadline: float | None = None
    while pending:
        deadline = next_deadline if grace_deadline is None else min(next_deadline, grace_deadline)
        left = deadline - time.monotonic()
        if left <= 0:
            return values, errors, order
        try:
            rank, status, value = results.get(timeout=min(left, _POLL_S))
        except queue.Empty:
            exited = [r for r in sorted(pending) if procs[r].exitcode is not None]
            if not exited:
                continue
            # A rank's queued outcome is in the pipe before its process ends, but may land
            # just after the check above: read what is there before calling it silent.
            try:
                rank, status, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                for r in exited:
                    pending.discard(r)
                    order.append(r)
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + grace
                continue
        pending.discard(rank)
        next_deadline = time.monotonic() + timeout
        if status == "ok":
            values[rank] = value
            continue
        errors[rank] = value
        order.append(rank)
        if grace_deadline is None:
            grace_deadline = time.monotonic() + grace
    return values, errors, order


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    backend: str = "gloo",
    grace: float = REPORT_GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` real processes on gloo (or
    ``backend``: ``"nccl"`` for one rank per GPU on a CUDA machine).

    ``fn`` must be a module-level function and its return value picklable. Returns the
    results ordered by rank. Any rank's failure fails the calling test with every rank's
    outcome: each error's traceback, ``ok`` for a rank that finished, and for a rank that
    did not report (within ``timeout`` seconds of the last outcome, or ``grace`` seconds
    of the first failure) its process's exit code or signal, or that it was still running.
    The first rank to fail is marked: the others' errors are often only its echo (a
    collective whose peer is gone).
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
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    order: list[int] = []
    try:
        values, errors, order = _collect(results, procs, timeout, grace)
    finally:
        failed = len(values) < world_size
        statuses = []
        for p in procs:
            p.join(timeout=10 if not failed else 1)
            # Read before kill(): "still running" is what the test needs to know.
            statuses.append(_exit_status(p))
            if p.is_alive():
                p.kill()
                p.join()
    if len(values) == world_size:
        return [values[r] for r in range(world_size)]
    lines = []
    for rank in range(world_size):
        first = " (the first to fail)" if order and order[0] == rank else ""
        if rank in values:
            lines.append(f"rank {rank}: ok")
        elif rank in errors:
            lines.append(f"rank {rank} failed{first}:\n{errors[rank].rstrip()}")
        elif statuses[rank] == "still running":
            waited = f"{grace:.0f}s after the first failure" if order else f"for {timeout:.0f}s"
            lines.append(f"rank {rank} did not report: still running {waited}, killed")
        else:
            lines.append(f"rank {rank} did not report{first}: {statuses[rank]}")
    pytest.fail("\n".join(lines), pytrace=False)


class HostReads:
    """Counts the host reads of a tensor's value on the calling thread: every
    ``aten._local_scalar_dense`` (what ``item()``, ``float(t)``, ``int(t)`` and ``bool(t)``
    dispatch to; on an accelerator each one waits for the device's queue: a sync). A
    context manager over a ``TorchDispatchMode``, which is thread-local: the telemetry
    thread's reads are not counted. Not seen: ``tolist()`` of a CPU tensor (it reads host
    memory without dispatching), so compare counts of code that reads with ``item()``/
    ``bool()``, as a device's values are read (``tolist()`` of a device tensor dispatches a
    copy instead, not counted either).

    ::

        with HostReads() as census:
            engine.step()
        assert census.count == 0
    """

    def __init__(self) -> None:
        self.count = 0
        self._mode: Any = None

    def __enter__(self) -> HostReads:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self
        local_scalar = torch.ops.aten._local_scalar_dense.default

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if func is local_scalar:
                    census.count += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Count()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
