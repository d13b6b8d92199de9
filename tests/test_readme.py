"""The README: the two commands first, and every link into the docs leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_starts_with_the_two_setup_commands() -> None:
    assert README.index("```bash\n") < README.index("\n## "), "something before the commands"
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_stays_short() -> None:
    assert len(README.splitlines()) <= 150


def test_every_local_link_and_image_resolves() -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [target for target in targets if "://" not in target]
    assert any(target.startswith("docs/images/") for target in local), "no picture"
    for target in local:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor:
            # The anchors GitHub and the docs site give headings (Python-Markdown's toc).
            md = markdown.Markdown(extensions=["toc"])
            md.convert((ROOT / path).read_text())
            anchors = set()
            stack = list(md.toc_tokens)  # type: ignore[attr-defined]
            while stack:
                token = stack.pop()
                anchors.add(token["id"])
                stack.extend(token["children"])
            assert anchor in anchors, target


def test_links_every_docs_page() -> None:
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\(docs/([a-z0-9-]+\.md)", README))
    assert pages - linked == set(), "docs pages the README does not link"
