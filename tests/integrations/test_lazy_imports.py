"""ampscope gains no dependency on the libraries it integrates with."""

from __future__ import annotations

import json
import subprocess
import sys

LIBRARIES = {
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "olmo_core",
    "torchtitan",
    "deepspeed",
}
SERVER_STACK = {"fastapi", "starlette", "uvicorn", "prometheus_client"}

# One interpreter, two stages (each import of torch and the libraries costs seconds).
SCRIPT = """
import importlib, json, sys
def top_level():
    return sorted({m.split('.')[0] for m in sys.modules})
for name in (
    "ampscope",
    "ampscope.integrations",
    "ampscope.integrations.accelerate",
    "ampscope.integrations.deepspeed",
):
    importlib.import_module(name)
stages = [top_level()]
for name in (
    "ampscope.integrations.transformers",
    "ampscope.integrations.lightning",
    "ampscope.integrations.olmo_core",
    "ampscope.integrations.torchtitan",
):
    importlib.import_module(name)
stages.append(top_level())
print(json.dumps(stages))
"""


def test_integrations_import_their_library_only_when_used() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    core, callbacks = (set(stage) for stage in json.loads(out.splitlines()[-1]))
    # ampscope and the Accelerate and DeepSpeed integrations (duck-typed) import no
    # training library.
    assert "torch" in core  # proof the scaler side really was imported
    assert not core & (LIBRARIES | SERVER_STACK)
    # The callback-based integrations import their library, never the server stack.
    assert {"transformers", "lightning", "olmo_core", "torchtitan"} <= callbacks
    assert not callbacks & SERVER_STACK
