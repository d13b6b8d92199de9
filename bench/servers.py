"""The servers under load: ``ampscope serve`` and Prometheus Pushgateway as subprocesses;
the stores the at-scale benchmarks read (VictoriaMetrics, Prometheus).

Each listens on a free loopback port and are stopped (SIGTERM, then SIGKILL) when the
``with`` block ends. Start-up costs about a second for the exporter (Python imports) and
less for the Pushgateway.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

PUSHGATEWAY = "prometheus-pushgateway"
VICTORIA_METRICS = "victoria-metrics"
PROMETHEUS = "prometheus"


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (Linux only)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class ServerProcess:
    """A loopback HTTP server in a subprocess, ready once ``ready_path`` answers 200.

    Args:
        name: Label used in results and error messages.
        argv: Command line; ``{port}`` is replaced by the chosen port.
        ready_path: GET path polled until it answers 200.
        env: Environment of the process (default: this process's).
        start_timeout: Seconds to wait for readiness before giving up.
    """

    def __init__(
        self,
        *,
        name: str,
        argv: list[str],
        ready_path: str,
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.host = "127.0.0.1"
        self._argv = [a.replace("{port}", str(self.port)) for a in argv]
        self._ready_path = ready_path
        self._env = env
        self._start_timeout = start_timeout
        # Held open for the process's lifetime and closed in __exit__; a with-block
        # cannot span __enter__ and __exit__.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def __enter__(self) -> ServerProcess:
        self._proc = subprocess.Popen(
            self._argv, stdout=self._log, stderr=subprocess.STDOUT, env=self._env
        )
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}:\n{self._log_tail()}"
                )
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
                conn.request("GET", self._ready_path)
                if conn.getresponse().status == 200:
                    conn.close()
                    return self
                conn.close()
            except OSError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.name} not ready after {self._start_timeout:.0f}s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._log.close()


def ampscope_exporter(*extra_args: str) -> ServerProcess:
    """``ampscope serve`` with default settings on a free loopback port.

    Runs under the benchmark's own interpreter; ``AMPSCOPE_*`` variables are removed from
    its environment so that a token or limits set in the shell cannot change the numbers.
    """
    argv = [sys.executable, "-m", "ampscope.cli", "serve", "--host", "127.0.0.1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    return ServerProcess(
        name="ampscope-exporter",
        argv=[*argv, "--port", "{port}", "--log-level", "warning", *extra_args],
        ready_path="/healthz",
        env=env,
    )


def pushgateway_path() -> str | None:
    """Where Debian's ``prometheus-pushgateway`` is installed, if it is."""
    return shutil.which(PUSHGATEWAY)


def pushgateway(path: str) -> ServerProcess:
    """Prometheus Pushgateway on a free loopback port, in memory only (no persistence)."""
    return ServerProcess(
        name="pushgateway",
        argv=[
            path,
            "--web.listen-address=127.0.0.1:{port}",
            "--persistence.file=",
            "--log.level=warn",
        ],
        ready_path="/-/ready",
    )


def victoria_metrics(path: str, data_dir: Path, *extra_args: str) -> ServerProcess:
    """VictoriaMetrics (single node) on a free loopback port, storing under ``data_dir``.

    ``-search.maxLookback=5m`` is Prometheus' default lookback delta: samples imported
    ``bench.simulated_job``'s scrape interval apart are then found by instant queries as
    Prometheus would find them (VictoriaMetrics otherwise derives the lookback from the
    interval between samples). ``-search.latencyOffset=0s``: by default VictoriaMetrics
    evaluates a query timed within 30 s of now 30 s in the past unless it says
    ``nocache=1`` (``ampscope status`` does not), so the newest scrapes would not count.
    """
    return ServerProcess(
        name="victoria-metrics",
        argv=[
            path,
            f"-storageDataPath={data_dir}",
            "-httpListenAddr=127.0.0.1:{port}",
            "-search.maxLookback=5m",
            "-search.latencyOffset=0s",
            "-loggerLevel=ERROR",
            *extra_args,
        ],
        ready_path="/health",
    )


def prometheus(path: str, tsdb: Path) -> ServerProcess:
    """Prometheus on a free loopback port serving the blocks under ``tsdb`` (backfilled:
    ``bench.prometheus_tsdb``), scraping nothing; its config is written beside ``tsdb``.
    Retention is ten years, so a data directory reused weeks later still holds the job."""
    config = tsdb.parent / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    return ServerProcess(
        name="prometheus",
        argv=[
            path,
            f"--config.file={config}",
            f"--storage.tsdb.path={tsdb}",
            "--storage.tsdb.retention.time=3650d",
            "--web.listen-address=127.0.0.1:{port}",
            "--log.level=error",
        ],
        ready_path="/-/ready",
    )
