"""The wheel stands alone: built from the sdist, installed into a fresh virtual environment
with no checkout on its path, it exports the deployment files and serves.

The fresh environment borrows this one's installed dependencies (torch's CPU build, FastAPI…)
through a path entry instead of downloading them: what is under test is what the wheel itself
carries. Costs about 15 s (the build dominates).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest
from repo_assets import ROOT, checkout_files, tree
from support import free_port, need_tool

import ampscope

pytestmark = pytest.mark.timeout(240)

NOT_SOURCE = (
    ".git",
    ".venv",
    "*.egg-info",
    "build",
    "dist",
    "node_modules",
    "__pycache__",
    ".*_cache",
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel from `python -m build` (the wheel is built from the unpacked sdist)."""
    out = tmp_path_factory.mktemp("dist")
    # From a clean copy: setuptools also packs whatever an earlier build's *.egg-info/SOURCES.txt
    # lists, which would hide a file the package-data globs in pyproject.toml no longer ship.
    source = tmp_path_factory.mktemp("source") / "ampscope"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fresh_env(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding only the wheel, seeing this one's dependencies."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A plain path entry: this environment's own .pth files (the editable install's link to
    # the checkout among them) are not processed through it.
    (Path(purelib) / "borrowed-dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    (wheel,) = dist.glob("ampscope-*.whl")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=env_dir,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return env_dir


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}


def test_sdist_and_wheel_carry_the_deployment_files(dist: Path) -> None:
    expected = {f"ampscope/bundle/assets/{relative}" for relative in checkout_files()}
    (wheel,) = dist.glob("ampscope-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assets = {name for name in archive.namelist() if name.startswith("ampscope/bundle/assets/")}
    # Exactly those: nothing else under dashboards/ or deploy/ (the dashboard's generator in
    # dashboards/src) rides along.
    assert assets == expected
    (sdist,) = dist.glob("ampscope-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1]: m for m in archive.getmembers() if "/" in m.name}
    assert expected <= set(members)
    # Real files, not the checkout's links, so the sdist builds anywhere.
    assert all(members[name].isfile() for name in expected)


def test_installed_wheel_exports_the_checkout_files_and_serves(
    fresh_env: Path, tmp_path: Path
) -> None:
    python, ampscope_cli = fresh_env / "bin" / "python", fresh_env / "bin" / "ampscope"
    where = subprocess.run(
        [python, "-c", "import ampscope, sys; print(ampscope.__file__); print(sys.path)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=_clean_env(),
    ).stdout
    module_file, path = where.splitlines()
    assert Path(module_file).is_relative_to(fresh_env), module_file
    checkout = str(Path(ampscope.__file__).resolve().parent.parent)
    assert checkout not in ast.literal_eval(path), "the checkout is on the path"

    out = tmp_path / "exported"
    exported = subprocess.run(
        [ampscope_cli, "export", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert exported.returncode == 0, exported.stderr
    assert tree(out) == {relative: p.read_bytes() for relative, p in checkout_files().items()}
    json.loads((out / "dashboards" / "ampscope.json").read_text())

    promtool = need_tool("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", *sorted(str(p.name) for p in (out / "prometheus" / "rules").glob("*"))],
        ["test", "rules", *sorted(f"tests/{p.name}" for p in (out / "prometheus/tests").glob("*"))],
    ):
        cwd = out / "prometheus" / ("rules" if args[:2] == ["check", "rules"] else "")
        checked = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
        )
        assert checked.returncode == 0, (args, checked.stdout + checked.stderr)

    with _serving(ampscope_cli, tmp_path) as url:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            body = response.read().decode()
        assert "ampscope_exporter_tracked_runs 0.0" in body


class _serving:
    """`ampscope serve` from the fresh environment, up until the block ends."""

    def __init__(self, ampscope_cli: Path, cwd: Path) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [ampscope_cli, "serve", "--port", str(self.port), "--log-level", "warning"],
            cwd=cwd,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()[0]
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return url
            except OSError:
                time.sleep(0.2)
        pytest.fail("the installed `ampscope serve` did not answer /healthz within 60 s")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
