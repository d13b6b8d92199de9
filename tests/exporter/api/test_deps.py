"""Request dependencies run on the event loop, not in FastAPI's thread pool.

FastAPI runs a plain ``def`` dependency through the thread pool; for the attribute reads in
deps.py those hand-offs cost more than the work (bench/: ingest requests/s at 64 ranks went
from 613 to 790 when they became ``async def``). This is the structural check that keeps
them so; the throughput itself is measured in bench/.
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

from fastapi import params

import ampscope.exporter
from ampscope.exporter.api import deps


def _dependencies() -> dict[str, object]:
    """Alias name -> the callable its ``Depends``/``Security`` marker runs."""
    found = {}
    for name, value in vars(deps).items():
        if typing.get_origin(value) is typing.Annotated:
            for marker in typing.get_args(value)[1:]:
                if isinstance(marker, params.Depends):
                    found[name] = marker.dependency
    return found


def test_every_dependency_is_a_coroutine() -> None:
    found = _dependencies()
    assert {"SettingsDep", "StoreDep", "StatsDep", "ClockDep", "Authorized"} <= set(found)
    sync = [name for name, call in found.items() if not inspect.iscoroutinefunction(call)]
    assert not sync, f"run in the thread pool on every request: {sync}"


def test_routes_take_their_dependencies_from_deps() -> None:
    """A dependency declared elsewhere would escape the check above."""
    package = Path(ampscope.exporter.__file__).parent
    elsewhere = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "deps.py"
        and ("Depends(" in path.read_text() or "Security(" in path.read_text())
    ]
    assert not elsewhere
