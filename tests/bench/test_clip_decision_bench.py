"""``bench.clip_decision`` runs both contenders (no timing is asserted)."""

from __future__ import annotations

import sys

import pytest
from support import need_module

need_module("olmo_core")


def test_both_contenders_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import clip_decision

    monkeypatch.setattr(sys, "argv", ["clip_decision", "--params", "8", "--steps", "2"])
    clip_decision.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "per step" in line]
    assert [line.split(":")[0] for line in lines] == ["read-twice", "read-once"]
    assert all(line.endswith("8 parameters") for line in lines)
