"""`ampscope export`: the shipped deployment files, written out in the checkout's layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_assets import CHECKOUT_DIRS, checkout_files, tree

from ampscope.bundle import asset_files
from ampscope.cli import main


def test_assets_are_the_checkout_files() -> None:
    # The package's assets are links into the checkout: one copy, and no link left dangling.
    shipped = {relative: entry.read_bytes() for relative, entry in asset_files()}
    expected = {relative: path.read_bytes() for relative, path in checkout_files().items()}
    assert shipped == expected
    assert {"dashboards/ampscope.json", "prometheus/rules/ampscope-alerts.yml"} <= set(shipped)
    for top, directory in CHECKOUT_DIRS.items():
        assert any(relative.startswith(f"{top}/") for relative in shipped), directory


def test_export_writes_every_file_in_the_checkout_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "out")]) == 0
    written = tree(tmp_path / "out")
    assert written == {relative: path.read_bytes() for relative, path in checkout_files().items()}
    listed = capsys.readouterr().out.split()
    assert sorted(listed) == sorted(str(tmp_path / "out" / relative) for relative in written)


def test_export_replaces_older_files_and_keeps_others(tmp_path: Path) -> None:
    rules = tmp_path / "prometheus" / "rules" / "ampscope-alerts.yml"
    rules.parent.mkdir(parents=True)
    rules.write_text("groups: []\n")
    mine = tmp_path / "prometheus" / "rules" / "mine.yml"
    mine.write_text("groups: []\n")
    assert main(["export", "--quiet", str(tmp_path)]) == 0
    shipped = checkout_files()["prometheus/rules/ampscope-alerts.yml"]
    assert rules.read_bytes() == shipped.read_bytes()
    assert mine.read_text() == "groups: []\n"


def test_export_onto_a_file_fails_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("")
    assert main(["export", str(tmp_path / "taken")]) == 1
    assert "ampscope export:" in capsys.readouterr().err
