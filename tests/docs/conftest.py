"""The docs site, built once per session the way ``scripts/docs.sh`` builds it, into a
temporary folder instead of the checkout's ``site/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import need_module

ROOT = Path(__file__).resolve().parents[2]


def zensical_config(site_dir: Path) -> dict:
    """``mkdocs.yml`` for a copy of ``docs/`` beside ``site_dir`` (Zensical wants the pages
    under the config's folder), reading the code from this checkout."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["site_dir"] = str(site_dir)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            python = plugin["mkdocstrings"]["handlers"]["python"]
            python["paths"] = [str(ROOT / path) for path in python["paths"]]
    return config


def build_site(site_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run Zensical's strict build of this checkout's docs into ``site_dir``."""
    need_module("zensical")
    zensical = Path(sys.executable).with_name("zensical")
    if not zensical.exists():
        zensical = Path(shutil.which("zensical") or "zensical")
    project = site_dir.parent
    config = project / "mkdocs.yml"
    shutil.copytree(ROOT / "docs", project / "docs")
    config.write_text(yaml.safe_dump(zensical_config(site_dir), sort_keys=False))
    env = {
        **os.environ,
        # As scripts/docs.sh: the generated pages' extension, and this checkout's ampscope.
        "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]),
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [str(zensical), "build", "--strict", "--clean", "-f", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site's folder; the build must pass strictly."""
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    result = build_site(site_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    return site_dir
