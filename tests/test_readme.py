"""The README's references stay true to the code they describe."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from ampscope.service import main as serve_main
from ampscope.service.catalogue import CATALOGUE, RANK_LABELS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def test_starts_with_the_two_setup_commands() -> None:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_metric_reference_matches_the_catalogue() -> None:
    rows = re.findall(
        r"^\| `(ampscope_[a-z_]+)` \| (\w+) \| ([^|]+) \|", _section("Metric reference"), re.M
    )
    documented = {name: (type_, labels.strip()) for name, type_, labels in rows}
    assert set(documented) == {spec.name for spec in CATALOGUE}
    for spec in CATALOGUE:
        type_, labels = documented[spec.name]
        assert type_ == spec.type, spec.name
        extra = [label for label in spec.labels if label not in RANK_LABELS]
        for label in extra:
            assert f"`{label}`" in labels, (spec.name, label)
        assert ("rank labels" in labels) == set(RANK_LABELS).issubset(spec.labels), spec.name


def test_alert_reference_matches_the_rules() -> None:
    alerts = set()
    for path in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            alerts.update(rule["alert"] for rule in group["rules"] if "alert" in rule)
    documented = set(re.findall(r"^\| `(Ampscope\w+)` \|", _section("Alert rules"), re.M))
    assert alerts, "no alert rules found"
    assert documented == alerts


def test_every_serve_flag_is_explained_somewhere() -> None:
    parser = argparse.ArgumentParser()
    serve_main.add_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    shown = _section("The exporter: `ampscope serve`")
    missing = [flag for flag in flags - {"-h", "--help"} if f"`{flag}`" not in shown]
    assert not missing, f"serve flags the README does not mention: {missing}"


def test_every_status_flag_and_exit_status_is_explained() -> None:
    from ampscope.status import main as status_main

    parser = argparse.ArgumentParser()
    status_main.add_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    shown = _section("The web view and `ampscope status`")
    missing = [flag for flag in flags - {"-h", "--help"} if f"`{flag}`" not in shown]
    assert not missing, f"status flags the README does not mention: {missing}"
    prose = " ".join(shown.split())
    assert f"{status_main.EXIT_UNREACHABLE} the exporter cannot be reached" in prose
    assert f"{status_main.EXIT_NO_SUCH_RUN} it holds no such run" in prose
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", README):
        assert (ROOT / image).is_file(), image
