"""The docs' runnable examples run as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _python_block_after(page: str, marker: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(marker)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match is not None, f"no python block after {marker!r} in {page}"
    return match.group(1)


def test_the_single_process_bf16_example_skips_the_nan_step(tmp_path: Path) -> None:
    code = _python_block_after("bf16.md", "A single process, with no process group")
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "1"  # one step skipped, the NaN one
