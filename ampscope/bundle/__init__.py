"""The deployment files that ship inside the package, for people who installed a wheel.

``assets/`` holds the Grafana dashboard and provisioning files, the Prometheus config, rules
and their promtool tests, and the Kubernetes manifests. In a checkout its entries are links to
``dashboards/`` and ``deploy/``, which stay the only copy; building a wheel copies the files
they point to. ``ampscope export DIR`` writes them out (:mod:`ampscope.bundle.export`).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from importlib.resources.abc import Traversable

# Asset folder -> file-name suffixes shipped from it, one level at a time (matches the
# package-data globs in pyproject.toml).
ASSET_FILES: dict[str, tuple[str, ...]] = {
    "dashboards": (".json",),
    "dashboards/provisioning/dashboards": (".yml",),
    "dashboards/provisioning/datasources": (".yml",),
    "prometheus": ("prometheus.yml",),
    "prometheus/rules": (".yml",),
    "prometheus/tests": (".yml",),
    "kubernetes": (".yaml", "web-config.yml"),
}


def assets() -> Traversable:
    """The root of the shipped deployment files."""
    return resources.files(__name__) / "assets"


def asset_files() -> Iterator[tuple[str, Traversable]]:
    """Every shipped file as (path relative to the assets root, file), in a stable order."""
    root = assets()
    for folder, suffixes in ASSET_FILES.items():
        directory = root.joinpath(*folder.split("/"))
        if not directory.is_dir():
            continue
        for entry in sorted(directory.iterdir(), key=lambda e: e.name):
            if entry.is_file() and entry.name.endswith(suffixes):
                yield f"{folder}/{entry.name}", entry
