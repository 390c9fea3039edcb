"""The README and docs/*.md hold together: every relative link names a file that exists and,
where it names a section, a heading of that file; every marked example is run by a test.
A README rewritten or a page split loses no link silently."""

from __future__ import annotations

import re
from pathlib import Path

from tests.readme_examples import ROOT, documentation_pages

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(page: Path) -> str:
    """The page without its fenced blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose(page), re.M)}


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(page))
        if not re.match(r"[a-z]+:", target) and not target.startswith("#")
    ]


def broken_links() -> list[str]:
    broken = []
    for page in documentation_pages():
        for target in relative_links(page):
            path, _, section = target.partition("#")
            linked = (page.parent / path).resolve()
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif section and linked.suffix == ".md" and section not in anchors(linked):
                broken.append(f"{where}: no such heading in {linked.name}")
    return broken


def test_every_link_between_the_pages_resolves_to_a_file_and_a_heading():
    assert broken_links() == []


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    """Guards the previous test: it finds links at all, and a wrong one is reported."""
    readme_links = relative_links(ROOT / "README.md")
    assert any(link.startswith("docs/") for link in readme_links)
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](page.md#title) [b](gone.md) [c](page.md#nowhere)\n")
    monkeypatch.setattr(f"{__name__}.documentation_pages", lambda: [page])
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert broken_links() == [
        "page.md -> gone.md: no such file",
        "page.md -> page.md#nowhere: no such heading in page.md",
    ]


def test_every_marked_example_is_run_by_a_test():
    names = {
        name
        for page in documentation_pages()
        for name in re.findall(r"<!-- readme-example: (\S+) -->\n```python", page.read_text())
    }
    assert names, "no marked example found"
    tests = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    assert {name for name in names if f'"{name}"' not in tests} == set()
