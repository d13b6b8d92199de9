"""Reading a Prometheus file_sd file for ``ampscope status --targets``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampscope.status import targets
from ampscope.status.targets import TargetsError, parse_targets, read_targets

RECIPE = '- targets: ["gpu-001:9478", "gpu-002:9478"]\n'
"""What docs/deployment.md's Slurm recipe writes."""


def test_the_recipe_json_and_block_yaml_give_the_same_targets() -> None:
    expected = ["gpu-001:9478", "gpu-002:9478"]
    assert parse_targets(RECIPE) == expected
    assert parse_targets('[{"targets": ["gpu-001:9478"], "labels": {"job": "x"}},'
                         ' {"targets": ["gpu-002:9478", "gpu-001:9478"]}]') == expected  # fmt: skip
    block = (
        "# job 4242\n- targets:\n    - gpu-001:9478\n    - 'gpu-002:9478'\n  labels:\n    a: b\n"
    )
    assert parse_targets(block) == expected


def test_without_pyyaml_the_recipes_forms_are_read_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = ["gpu-001:9478", "gpu-002:9478"]
    monkeypatch.setitem(__import__("sys").modules, "yaml", None)  # import yaml fails
    assert parse_targets(RECIPE) == expected
    assert targets._parse_simple_yaml("- targets:\n  - gpu-001:9478\n  - gpu-002:9478\n") == [
        {"targets": expected}
    ]
    with pytest.raises(TargetsError, match="not understood without PyYAML"):
        parse_targets("- targets: [a:1]\nweird: {x: 1}\n")


@pytest.mark.parametrize(
    "text",
    ["{}", "[]\n- x", '[{"labels": {}}]', '[{"targets": [1]}]', "targets: 7"],
)
def test_malformed_files_are_refused(text: str) -> None:
    with pytest.raises(TargetsError):
        parse_targets(text)


def test_read_targets_adds_the_scheme_and_refuses_empty_files(tmp_path: Path) -> None:
    path = tmp_path / "t.yml"
    path.write_text(RECIPE)
    assert read_targets(str(path), "https") == ["https://gpu-001:9478", "https://gpu-002:9478"]
    path.write_text("[]")
    with pytest.raises(TargetsError, match="lists no target"):
        read_targets(str(path), "http")
    with pytest.raises(TargetsError, match="cannot read --targets"):
        read_targets(str(tmp_path / "absent.yml"), "http")
