"""The rank side never imports the server stack, and the exporter never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ampscope

SERVER_STACK = ("fastapi", "starlette", "uvicorn", "prometheus_client")
PACKAGE = Path(ampscope.__file__).parent


def _imported_after(modules: list[str]) -> set[str]:
    """Top-level packages in sys.modules after importing ``modules`` in a fresh interpreter."""
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def _rank_side_modules() -> list[str]:
    return [
        "ampscope",
        "ampscope.reporter",
        "ampscope.reporter.http",
        "ampscope.reporter.sinks",
        "ampscope.rank",
    ]


def test_rank_side_does_not_import_the_server_stack():
    modules = _rank_side_modules()
    loaded = _imported_after(modules)
    assert "ampscope" in loaded
    assert "pydantic" in loaded  # proof the reporter really was imported
    leaked = sorted(loaded.intersection(SERVER_STACK))
    assert not leaked, f"importing {modules} pulled in {leaked}"


def test_exporter_does_not_import_torch():
    # ampscope.exporter.main is what `ampscope serve` runs.
    modules = [
        "ampscope.exporter",
        "ampscope.exporter.app",
        "ampscope.exporter.main",
        "ampscope.cli",
    ]
    loaded = _imported_after(modules)
    assert "fastapi" in loaded  # proof the app really was imported
    assert "torch" not in loaded, f"importing {modules} pulled in torch"


def test_status_needs_neither_torch_nor_the_server_stack():
    loaded = _imported_after(
        ["ampscope.status.main", "ampscope.status.render", "ampscope.status.prometheus"]
    )
    assert "pydantic" in loaded  # the default address comes from the schema module
    leaked = sorted(loaded.intersection({"torch", *SERVER_STACK}))
    assert not leaked, f"`ampscope status` pulled in {leaked}"


def test_verdicts_are_pure():
    """The rules are shared by the exporter and `ampscope status`: plain Python over plain data."""
    modules = [f"ampscope.verdicts.{p.stem}" for p in (PACKAGE / "verdicts").glob("*.py")]
    loaded = _imported_after(modules)
    leaked = sorted(loaded.intersection({"torch", *SERVER_STACK}))
    assert not leaked, f"importing {modules} pulled in {leaked}"


def test_devices_needs_neither_torch_nor_the_server_stack():
    loaded = _imported_after(["ampscope.devices.main", "ampscope.devices.ranking"])
    assert "ampscope" in loaded
    leaked = sorted(loaded.intersection({"torch", *SERVER_STACK}))
    assert not leaked, f"`ampscope devices` pulled in {leaked}"
