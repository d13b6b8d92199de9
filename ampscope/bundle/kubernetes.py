"""The Kubernetes manifests derived from other shipped files, generated so they cannot drift.

- ``prometheusrule.yaml``: a Prometheus Operator ``PrometheusRule`` holding exactly the groups
  of ``deploy/prometheus/rules/*.yml``;
- ``dashboard-configmap.yaml``: the Grafana dashboard as a ConfigMap labelled for Grafana's
  dashboard sidecar.

Regenerate after changing the rules or the dashboard (tests/deploy/test_kubernetes.py fails
until then)::

    python -m ampscope.bundle.kubernetes deploy/kubernetes

The hand-written ``daemonset.yaml`` says how training pods set ``NODE_NAME`` and
``AMPSCOPE_NODE`` from ``spec.nodeName`` (the Downward API), so the ranks' ``hostname`` is
the node's name that DCGM-exporter's host label holds.

The YAML is written as text, indenting the sources into place, so the rules keep their
comments and the package needs no YAML library at run time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampscope.bundle import assets

NAMESPACE = "ampscope"
LABELS = {"app.kubernetes.io/name": "ampscope", "app.kubernetes.io/part-of": "ampscope"}
REGENERATE = "python -m ampscope.bundle.kubernetes deploy/kubernetes"


def _header(source: str) -> str:
    return f"# Generated from {source} by `{REGENERATE}`: edit the source, then regenerate.\n"


def _metadata(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> str:
    lines = ["metadata:", f"  name: {name}", f"  namespace: {NAMESPACE}", "  labels:"]
    lines += [f'    {key}: "{value}"' for key, value in labels.items()]
    if annotations:
        lines += ["  annotations:"]
        lines += [f'    {key}: "{value}"' for key, value in annotations.items()]
    return "\n".join(lines) + "\n"


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def prometheus_rule(rule_files: dict[str, str]) -> str:
    """A PrometheusRule whose ``spec.groups`` are the groups of every rules file, in order.

    Args:
        rule_files: File name -> text of a Prometheus rules file whose only top-level key is
            ``groups:``, written in block style (as promtool and the house style write them).

    Raises:
        ValueError: a file has no top-level ``groups:`` line.
    """
    groups = []
    for name, text in rule_files.items():
        lines = text.splitlines(True)
        starts = [i for i, line in enumerate(lines) if line.rstrip() == "groups:"]
        if len(starts) != 1:
            raise ValueError(f"{name}: expected one top-level 'groups:' line")
        groups.append(f"# {name}\n" + "".join(lines[starts[0] + 1 :]))
    return (
        _header("deploy/prometheus/rules/*.yml")
        + "apiVersion: monitoring.coreos.com/v1\n"
        + "kind: PrometheusRule\n"
        + _metadata("ampscope", {**LABELS, "app.kubernetes.io/component": "alerting"})
        + "spec:\n  groups:\n"
        + _indent("".join(groups), 2)
    )


def dashboard_configmap(dashboards: dict[str, str]) -> str:
    """A ConfigMap holding every dashboard JSON, for Grafana's dashboard sidecar.

    The sidecar (kube-prometheus-stack's and Grafana's Helm chart's ``sidecar.dashboards``)
    loads ConfigMaps labelled ``grafana_dashboard: "1"``; ``grafana_folder`` names the folder
    where its ``folderAnnotation`` is set to that key.
    """
    data = []
    for name, text in dashboards.items():
        chomp = "" if text.endswith("\n") else "-"
        data.append(f"  {name}: |{chomp}\n" + _indent(text, 4))
    return (
        _header("dashboards/*.json")
        + "apiVersion: v1\n"
        + "kind: ConfigMap\n"
        + _metadata(
            "ampscope-dashboards",
            {**LABELS, "app.kubernetes.io/component": "dashboards", "grafana_dashboard": "1"},
            {"grafana_folder": "ampscope"},
        )
        + "data:\n"
        + "".join(data)
    )


def generated() -> dict[str, str]:
    """File name -> text of every generated manifest, from the shipped rules and dashboards."""
    root = assets()
    rules = {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in sorted((root / "prometheus" / "rules").iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".yml")
    }
    dashboards = {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in sorted((root / "dashboards").iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".json")
    }
    return {
        "prometheusrule.yaml": prometheus_rule(rules),
        "dashboard-configmap.yaml": dashboard_configmap(dashboards),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ampscope.bundle.kubernetes", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("directory", type=Path, help="where to write, e.g. deploy/kubernetes")
    args = parser.parse_args(argv)
    for name, text in generated().items():
        path = args.directory / name
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
