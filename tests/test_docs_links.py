"""README, docs/ and benchmarks/README.md: every relative link resolves; the README is a door.

Relative Markdown links `[text](path)` are checked against the file system, relative to the file
that holds them (a `#fragment` is dropped; web addresses and pure `#anchors` are not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 160
SETUP_COMMANDS = ("specdecode bench", "python -m pytest -q")

# [text](target) or [text](target "title"); the text may hold backticks but no brackets
LINK = re.compile(r"\[[^\[\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def relative_links(text: str) -> list[str]:
    """Targets of the relative links in Markdown `text`, fragments dropped (code blocks skipped)."""
    targets = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s), mailto, ... and anchors within the page
        path = target.split("#", 1)[0]
        if path:
            targets.append(path)
    return targets


def broken_links(document: Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    return [t for t in relative_links(text) if not (document.parent / t).exists()]


def test_documents_exist():
    for document in documents():
        assert document.is_file(), f"{document.relative_to(ROOT)} is missing"


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path):
    assert broken_links(document) == [], f"broken links in {document.relative_to(ROOT)}"


def test_readme_is_short_and_has_the_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in SETUP_COMMANDS:
        assert command in text, f"README.md lacks the set-up command {command!r}"


def test_link_extraction_sees_a_broken_link(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text(
        "[ok](there.md#part) [web](https://example.org/x) [anchor](#top) "
        "[`code` text](missing/file.txt) and\n```\n[in a block](nowhere.md)\n```\n"
    )
    assert relative_links(page.read_text()) == ["there.md", "missing/file.txt"]
    assert broken_links(page) == ["missing/file.txt"]
