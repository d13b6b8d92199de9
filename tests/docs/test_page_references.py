"""The docs pages' references stay true to the code they describe."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from ampscope.exporter import main as serve_main
from ampscope.exporter.metrics.catalogue import CATALOGUE, RANK_LABELS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def section(page: str, title: str) -> str:
    """The ``## title`` section of ``docs/page``, up to the next ``## `` heading."""
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def flags(add_arguments: object) -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # type: ignore[operator]
    return {opt for action in parser._actions for opt in action.option_strings} - {"-h", "--help"}


def test_the_generated_metric_table_matches_the_catalogue() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from docs_generated import metric_table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = re.findall(r"^\| `(ampscope_[a-z0-9_]+)` \| (\w+) \| ([^|]+) \|", metric_table(), re.M)
    documented = {name: (type_, labels.strip()) for name, type_, labels in rows}
    assert set(documented) == {spec.name for spec in CATALOGUE}
    for spec in CATALOGUE:
        type_, labels = documented[spec.name]
        assert type_ == spec.type, spec.name
        for label in spec.labels:
            if label not in RANK_LABELS:
                assert f"`{label}`" in labels, (spec.name, label)
        assert ("rank labels" in labels) == set(RANK_LABELS).issubset(spec.labels), spec.name


def test_the_metric_page_is_generated_not_copied() -> None:
    text = (DOCS / "metrics.md").read_text()
    assert "<!-- generated: metric-table -->" in text
    assert not re.search(r"^\| `ampscope_", text, re.M), "a hand-written metric row"


def test_alert_reference_matches_the_rules() -> None:
    alerts = set()
    for path in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            alerts.update(rule["alert"] for rule in group["rules"] if "alert" in rule)
    shown = section("dashboards.md", "Alert rules")
    documented = set(re.findall(r"^\| `(Ampscope\w+)` \|", shown, re.M))
    assert alerts, "no alert rules found"
    assert documented == alerts


def test_every_serve_flag_is_explained() -> None:
    shown = (DOCS / "exporter.md").read_text()
    missing = [flag for flag in flags(serve_main.add_arguments) if f"`{flag}`" not in shown]
    assert not missing, f"serve flags docs/exporter.md does not mention: {missing}"


def test_every_status_flag_and_exit_status_is_explained() -> None:
    from ampscope.status import main as status_main

    shown = (DOCS / "web-view.md").read_text()
    missing = [flag for flag in flags(status_main.add_arguments) if f"`{flag}`" not in shown]
    assert not missing, f"status flags docs/web-view.md does not mention: {missing}"
    prose = " ".join(shown.split())
    assert f"{status_main.EXIT_UNREACHABLE} the exporter cannot be reached" in prose
    assert f"{status_main.EXIT_NO_SUCH_RUN} it holds no such run" in prose


def test_every_image_a_page_shows_exists() -> None:
    shown = []
    for page in DOCS.rglob("*.md"):
        for image in re.findall(r"!\[[^]]*\]\(([^)\s]+)", page.read_text()):
            shown.append(image)
            assert (page.parent / image).is_file(), (page.name, image)
    assert shown


def test_every_devices_flag_and_exit_status_is_explained() -> None:
    from ampscope.devices import main as devices_main

    shown = (DOCS / "hardware-triage.md").read_text()
    missing = [flag for flag in flags(devices_main.add_arguments) if f"`{flag}" not in shown]
    assert not missing, f"devices flags docs/hardware-triage.md does not mention: {missing}"
    prose = " ".join(shown.split())
    assert "0 no device offended in `--min-runs` runs or more, 1 one did, 3 Prometheus" in prose
    from ampscope.devices.ranking import KINDS

    for name in KINDS:
        assert f"| `{name}` |" in shown, name
    # An origin outlier is explained as no offence, not listed as one.
    assert "| `origin_outlier` |" not in shown
    assert "An **origin outlier** (`origin_outlier`" in shown
    assert "not emitted yet" not in prose  # transient_fault is counted since #29
