"""ampscope gains no dependency on the libraries it integrates with."""

from __future__ import annotations

import json
import subprocess
import sys

LIBRARIES = ("transformers", "accelerate", "lightning", "pytorch_lightning")
SERVER_STACK = ("fastapi", "starlette", "uvicorn", "prometheus_client")


def _imported_after(modules: list[str]) -> set[str]:
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_ampscope_and_the_accelerate_integration_import_no_training_library() -> None:
    # The Accelerate integration works on the accelerator it is given (duck-typed).
    loaded = _imported_after(
        ["ampscope", "ampscope.integrations", "ampscope.integrations.accelerate"]
    )
    assert "torch" in loaded  # proof the scaler side really was imported
    assert not loaded.intersection(LIBRARIES + SERVER_STACK)


def test_the_callback_integrations_import_no_server_stack() -> None:
    modules = ["ampscope.integrations.lightning", "ampscope.integrations.transformers"]
    loaded = _imported_after(modules)
    assert {"lightning", "transformers"} <= loaded
    assert not loaded.intersection(SERVER_STACK)
