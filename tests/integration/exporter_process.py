"""The real exporter (``python -m ampscope.cli serve``) as a subprocess on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class ExporterProcess:
    """Starts, kills (SIGKILL) and restarts ``ampscope serve`` on one fixed port.

    Args:
        port: TCP port on 127.0.0.1, kept across restarts.
        log_dir: Where each start's stdout/stderr go (shown when a start fails).
        env: Extra environment for the exporter (e.g. ``AMPSCOPE_TOKEN``).
    """

    def __init__(self, port: int, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log_dir = log_dir
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
        self._env.update(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> None:
        """Start the exporter and wait until ``/healthz`` answers."""
        self.starts += 1
        log = self._log_dir / f"exporter-{self.starts}.log"
        command = [sys.executable, "-m", "ampscope.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--log-level", "warning"]
        with open(log, "wb") as out:
            self._proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env,
            )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"exporter did not come up on {self.url}:\n{log.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run, in-memory state is lost."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return str(response.read().decode())
