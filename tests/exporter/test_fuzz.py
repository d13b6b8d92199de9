"""Schemathesis against a live `ampscope serve`: no 5xx, every answer as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from exporter.http.test_server import serve

TOKEN = "fuzz-token"
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
    "missing_required_header",
    "error_body",  # ours: tests/exporter/fuzz_checks.py
)
EXAMPLES_PER_OPERATION = 20
"""About 800 requests over all phases: 20-40 s on a 2-core box."""


def test_schemathesis_finds_nothing(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with serve(tmp_path, "--token-file", str(token_file), "--log-level", "warning") as server:
        env = {
            **os.environ,
            # tests/, not tests/exporter/: its http/ (mirroring ampscope/exporter/http)
            # would hide the standard library's http from schemathesis.
            "PYTHONPATH": str(Path(__file__).parents[1]),
            "SCHEMATHESIS_HOOKS": "exporter.fuzz_checks",
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{server.url}/openapi.json",
                "--header",
                f"Authorization: Bearer {TOKEN}",
                "--checks",
                ",".join(CHECKS),
                "--mode",
                "all",
                "--max-examples",
                str(EXAMPLES_PER_OPERATION),
                "--seed",
                "8",
                "--generation-database",
                "none",
                "--request-timeout",
                "10",
                "--no-color",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        log = server.log.read_text()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "No issues found" in output, output[-3000:]
    assert "Traceback" not in log, log[-3000:]
