"""The deployment files as the checkout holds them, found without going through the package."""

from __future__ import annotations

from pathlib import Path

from ampscope.bundle import ASSET_FILES

ROOT = Path(__file__).resolve().parents[2]
# Where each asset folder's first component lives in the checkout.
CHECKOUT_DIRS = {
    "dashboards": ROOT / "dashboards",
    "prometheus": ROOT / "deploy" / "prometheus",
    "kubernetes": ROOT / "deploy" / "kubernetes",
}


def checkout_files() -> dict[str, Path]:
    """Every file the wheel must ship, by its path under the assets root."""
    found = {}
    for folder, suffixes in ASSET_FILES.items():
        top, *rest = folder.split("/")
        directory = CHECKOUT_DIRS[top].joinpath(*rest)
        for path in sorted(directory.glob("*")):
            if path.is_file() and path.name.endswith(suffixes):
                found[f"{folder}/{path.name}"] = path
    return found


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, by relative POSIX path, with its bytes."""
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
