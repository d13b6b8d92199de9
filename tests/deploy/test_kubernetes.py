"""deploy/kubernetes: the manifests against Kubernetes' and the Prometheus Operator's schemas
(offline, no cluster), the generated ones against their sources, and the house rules for the
exporter's DaemonSet."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_files import DASHBOARD_DIR, PROMETHEUS_DIR, ROOT
from support import IN_CI, need_tool

from ampscope.bundle.kubernetes import REGENERATE, generated
from ampscope.reporter.schema import DEFAULT_PORT

KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
VALIDATOR_DIR = Path(__file__).with_name("k8s-validate")
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
"""The oldest release still common in fleets that has everything used here, and the newest
kubernetes-validate knows."""
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _manifests() -> dict[str, dict[str, Any]]:
    """Every Kubernetes object under deploy/kubernetes, by file name (kustomization excluded)."""
    return {
        path.name: yaml.safe_load(path.read_text())
        for path in sorted(KUBERNETES_DIR.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    }


def _by_kind(kind: str) -> dict[str, Any]:
    (found,) = [m for m in _manifests().values() if m["kind"] == kind]
    return found


def test_kustomization_applies_every_manifest_in_one_namespace() -> None:
    kustomization = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(_manifests())
    assert {m["metadata"]["namespace"] for m in _manifests().values()} == {
        kustomization["namespace"]
    }


def test_generated_manifests_are_up_to_date() -> None:
    for name, text in generated().items():
        committed = (KUBERNETES_DIR / name).read_text()
        assert committed == text, f"deploy/kubernetes/{name} is stale: run `{REGENERATE}`"


def test_prometheus_rule_holds_exactly_the_shipped_rules() -> None:
    groups = [
        group
        for path in sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
        for group in yaml.safe_load(path.read_text())["groups"]
    ]
    assert groups
    assert _by_kind("PrometheusRule")["spec"]["groups"] == groups


def test_dashboard_configmap_holds_the_dashboards_for_grafanas_sidecar() -> None:
    configmap = _by_kind("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {
        path.name: path.read_text() for path in sorted(DASHBOARD_DIR.glob("*.json"))
    }
    for text in configmap["data"].values():
        json.loads(text)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_manifests_match_the_kubernetes_schemas(version: str) -> None:
    core = {n: m for n, m in _manifests().items() if m["kind"] not in OPERATOR_KINDS}
    assert {m["kind"] for m in core.values()} >= {"DaemonSet", "Service", "ConfigMap"}
    for name, manifest in core.items():
        # strict: unknown fields are errors, as with kubectl's default --validate=strict.
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name} against Kubernetes {version}: {error.message}")


def test_kubernetes_schema_check_catches_a_misspelt_field() -> None:
    broken = copy.deepcopy(_by_kind("DaemonSet"))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbes"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def _operator_errors(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    node = need_tool("node")
    if not (VALIDATOR_DIR / "node_modules").is_dir():
        message = f"run `npm ci` in {VALIDATOR_DIR} (scripts/setup.sh test does)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run(
        [node, "validate.mjs"],
        input=json.dumps(manifests),
        cwd=VALIDATOR_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_operator_manifests_match_the_prometheus_operator_schemas() -> None:
    operator = [m for m in _manifests().values() if m["kind"] in OPERATOR_KINDS]
    assert {m["kind"] for m in operator} == {"ServiceMonitor", "PrometheusRule"}
    verdicts = _operator_errors(operator)
    assert [v["kind"] for v in verdicts] == [m["kind"] for m in operator]
    assert all(not v["errors"] for v in verdicts), verdicts

    # The same validator refuses what the operator's API server would.
    monitor, rule = (
        copy.deepcopy(_by_kind("ServiceMonitor")),
        copy.deepcopy(_by_kind("PrometheusRule")),
    )
    monitor["spec"]["endpoints"][0]["interval"] = 15
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    bad = _operator_errors([monitor, rule])
    assert "interval" in bad[0]["errors"][0]
    assert "expr" in bad[1]["errors"][0]


def test_the_sample_limit_trips_only_past_the_exporters_own_series_limit() -> None:
    """The ServiceMonitor's ``sampleLimit`` is the TSDB's backstop: an exporter at its own
    ``max_series`` (plus its own families) still scrapes, and a wrong type is refused."""
    from fastapi.testclient import TestClient

    from ampscope.exporter.app import create_app
    from ampscope.exporter.settings import Settings

    settings = Settings()
    with TestClient(create_app(settings)) as client:
        body = client.get("/metrics").text
    own = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
    assert own > 0
    limit = _by_kind("ServiceMonitor")["spec"]["sampleLimit"]
    assert isinstance(limit, int)
    assert settings.max_series + own < limit <= 2 * settings.max_series
    monitor = copy.deepcopy(_by_kind("ServiceMonitor"))
    monitor["spec"]["sampleLimit"] = "sixty thousand"
    (verdict,) = _operator_errors([monitor])
    assert any("sampleLimit" in error for error in verdict["errors"]), verdict


def test_exporter_daemonset_runs_hardened_and_reachable_on_its_node() -> None:
    daemonset = _by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}, kind
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz", probe
    (port,) = container["ports"]
    assert port["containerPort"] == port["hostPort"] == DEFAULT_PORT
    assert f"--port={DEFAULT_PORT}" in container["args"]
    assert "--host=0.0.0.0" in container["args"]

    # The token comes from the Secret, through a file the exporter is pointed at.
    (token_flag,) = [a for a in container["args"] if a.startswith("--token-file=")]
    token_path = Path(token_flag.split("=", 1)[1])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (token_volume,) = [
        name for name, mount in mounts.items() if token_path.parent == Path(mount["mountPath"])
    ]
    secret = volumes[token_volume]["secret"]
    assert secret["secretName"] == "ampscope-token"
    assert token_path.name == "token"

    # The web config and the certificates it names, side by side, from Secrets.
    (web_flag,) = [a for a in container["args"] if a.startswith("--web-config-file=")]
    web_path = Path(web_flag.split("=", 1)[1])
    (web_volume,) = [
        name for name, mount in mounts.items() if web_path.parent == Path(mount["mountPath"])
    ]
    projected = {
        item["path"]: source["secret"]["name"]
        for source in volumes[web_volume]["projected"]["sources"]
        for item in source["secret"]["items"]
    }
    tls = yaml.safe_load((KUBERNETES_DIR / "web-config.yml").read_text())["tls_server_config"]
    assert projected[web_path.name] == "ampscope-web-config"
    for key in ("cert_file", "key_file", "client_ca_file"):
        assert projected[tls[key]] == "ampscope-tls", key
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe

    # The Service and the ServiceMonitor find these pods and this port.
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = _by_kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {port["name"]}
    monitor = _by_kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {
        p["name"] for p in service["spec"]["ports"]
    }
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "ampscope-tls", "key": "ca.crt"}
    assert set(endpoint["basicAuth"]) == {"username", "password"}


def test_example_web_config_passes_promtool_and_ampscope(tmp_path: Path) -> None:
    """deploy/kubernetes/web-config.yml beside real certificates named as the DaemonSet
    mounts them: the toolkit's own check and ampscope's loader both accept it."""
    from exporter.credentials import make_ca, make_leaf

    from ampscope.exporter.security.policy import WebSecurity

    ca = make_ca(tmp_path)
    server = make_leaf(tmp_path, "server", ca, "DNS:ampscope-exporter.ampscope.svc")
    (tmp_path / "tls.crt").write_bytes(server.cert.read_bytes())
    (tmp_path / "tls.key").write_bytes(server.key.read_bytes())
    (tmp_path / "ca.crt").write_bytes(ca.cert.read_bytes())
    config = tmp_path / "web-config.yml"
    config.write_text((KUBERNETES_DIR / "web-config.yml").read_text())
    result = subprocess.run(
        [need_tool("promtool"), "check", "web-config", str(config)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    security = WebSecurity.from_file(config)
    assert security.tls is not None
    assert set(security.config.users) == {"prometheus"}


def test_docs_name_every_manifest_and_the_regeneration_command() -> None:
    page = (ROOT / "docs" / "deployment.md").read_text()
    section = page[page.index("\n## Kubernetes\n") :]
    section = section[: section.index("\n## ", 1)]
    for path in KUBERNETES_DIR.glob("*.yaml"):
        assert f"`{path.name}`" in section, path.name
    assert f"`{REGENERATE}`" in section


def test_the_node_name_comes_from_the_downward_api() -> None:
    """DCGM-exporter labels its series with the node's name (NODE_NAME from spec.nodeName),
    and a pod's host name is the pod's: the DaemonSet sets NODE_NAME the same way and says
    how the training pods set it (the variable a rank reads for its hostname label)."""
    from ampscope.rank.telemetry.identity import NODE_NAME_ENV

    text = (KUBERNETES_DIR / "daemonset.yaml").read_text()
    (container,) = yaml.safe_load(text)["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env[NODE_NAME_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    assert f"#     - name: {NODE_NAME_ENV}\n" in header
    assert "#       valueFrom: {fieldRef: {fieldPath: spec.nodeName}}\n" in header
