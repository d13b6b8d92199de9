"""docker-compose.yml and the Dockerfile, checked without a Docker engine."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import ROOT

from ampscope.reporter.schema import DEFAULT_PORT


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def test_compose_file_matches_the_compose_specification() -> None:
    tool = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run(
        [tool, "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_mounted_or_built_path_exists(compose: dict[str, Any]) -> None:
    checked = 0
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build.get("context", ".")
            assert (ROOT / context / "Dockerfile").is_file(), name
            checked += 1
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), (name, source)
                checked += 1
            else:
                assert source in compose["volumes"], (name, source)
    assert checked >= 5


def test_services_and_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"exporter", "prometheus", "grafana", "demo"}
    for name in ("exporter", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"], name
        assert "profiles" not in services[name], name
    exporter = services["exporter"]
    assert exporter["command"][:3] == ["serve", "--host", "0.0.0.0"]
    assert any(port.endswith(f":{DEFAULT_PORT}") for port in exporter["ports"])
    assert "/healthz" in " ".join(exporter["healthcheck"]["test"])
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "./dashboards/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    demo = services["demo"]
    assert demo["profiles"] == ["demo"]
    assert demo["command"][0] == "demo"
    assert f"http://exporter:{DEFAULT_PORT}" in demo["command"]


def test_prometheus_scrapes_the_compose_exporter() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "ampscope"
    assert job["static_configs"][0]["targets"] == [f"exporter:{DEFAULT_PORT}"]


def test_dockerfile_installs_cpu_torch_as_non_root() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim$", dockerfile, re.M)
    assert "https://download.pytorch.org/whl/cpu" in dockerfile
    assert "-c constraints/pins.txt" in dockerfile
    assert '".[service]"' in dockerfile
    user = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert user
    assert user[-1] not in {"root", "0"}
    assert f"EXPOSE {DEFAULT_PORT}" in dockerfile
    # Everything the image COPYs exists and is let through .dockerignore.
    allowed = (ROOT / ".dockerignore").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
            assert f"!{path}" in allowed, path
