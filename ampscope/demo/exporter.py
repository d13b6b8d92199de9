"""The demo's exporter: ``ampscope serve`` as a child process on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class DemoError(Exception):
    """A problem the demo explains to its user and exits on (no traceback)."""


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET ``url`` and decode its JSON body; raises ``urllib.error.URLError`` on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def is_healthy(base_url: str) -> bool:
    """Whether ``{base_url}/healthz`` answers 200 right now."""
    try:
        with urllib.request.urlopen(f"{base_url}/healthz", timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Bind as uvicorn will (SO_REUSEADDR): connections of a previous run lingering in
        # TIME_WAIT must not read as "taken"; only a listening socket should.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ExporterProcess:
    """``ampscope serve`` on ``127.0.0.1:port``, logging to a file, stopped on ``stop()``.

    Can be started again on the same port after ``stop()`` or ``kill()``.

    Args:
        port: TCP port on 127.0.0.1.
        stale_after: The exporter's ``--stale-after``; ``None`` keeps its default.
        stall_after: The exporter's ``--stall-after``; ``None`` keeps its default.
        env: Variables added to the inherited environment (e.g. ``AMPSCOPE_TOKEN``).
    """

    def __init__(
        self,
        port: int,
        *,
        stale_after: float | None = None,
        stall_after: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stale_after = stale_after
        self.stall_after = stall_after
        self._env = {**os.environ, **env} if env else None
        self.log_path = Path(tempfile.gettempdir()) / f"ampscope-demo-exporter-{port}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the exporter and wait until /healthz answers.

        Raises:
            DemoError: the port is taken, or the exporter exited or did not become healthy
                within ``timeout`` seconds (the message quotes its log).
        """
        if not _port_is_free(self.port):
            hint = (
                "an exporter is already running there"
                if is_healthy(self.url)
                else "another program uses it"
            )
            raise DemoError(
                f"port {self.port} on 127.0.0.1 is taken ({hint}). Pick another with "
                f"--port, or report to a running exporter with --exporter-url {self.url}"
            )
        command = [sys.executable, "-m", "ampscope.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--log-level", "warning"]
        if self.stale_after is not None:
            command += ["--stale-after", str(self.stale_after)]
        if self.stall_after is not None:
            command += ["--stall-after", str(self.stall_after)]
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self._env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise DemoError(
                    f"the exporter exited with status {self._process.returncode}:\n"
                    + self.log_tail()
                )
            if is_healthy(self.url):
                return
            time.sleep(0.2)
        self.stop()
        raise DemoError(
            f"the exporter did not answer {self.url}/healthz within "
            f"{timeout:.0f}s:\n" + self.log_tail()
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait(self) -> None:
        """Block until the exporter exits (Ctrl-C interrupts)."""
        if self._process is not None:
            self._process.wait()

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run and the exporter's memory is lost, as in a crash."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the exporter (SIGTERM, then SIGKILL after ``timeout`` seconds)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
