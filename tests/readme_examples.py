"""The marked Python examples of README.md and docs/*.md, taken from the pages themselves so
that the script a user copies is the script the tests run (blocks marked
``<!-- readme-example: NAME -->``, optionally followed by ``prints `LINE` `` after the
block). A name is marked once across all the pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documentation_pages() -> list[Path]:
    """Every page a marked example may live on: the README, then docs/ in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def example_env() -> dict[str, str]:
    """The environment an example runs in: this checkout's paratrain importable."""
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def _block(name: str) -> tuple[str, re.Match]:
    marker = rf"<!-- readme-example: {re.escape(name)} -->\n```python\n(.*?)```"
    found = [
        (text, match)
        for text in (page.read_text() for page in documentation_pages())
        for match in re.finditer(marker, text, re.S)
    ]
    pages = ", ".join(str(page.relative_to(ROOT)) for page in documentation_pages())
    assert found, f"no page ({pages}) has the marked {name} example"
    assert len(found) == 1, f"{name} is marked {len(found)} times in {pages}; mark it once"
    return found[0]


def readme_example(name: str, folder: Path) -> Path:
    """The marked example written to ``folder/name``, as printed."""
    _, found = _block(name)
    script = folder / name
    script.write_text(found.group(1))
    return script


def run_readme_example(name: str, folder: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run the marked example in ``folder``; its completed process and the line the
    page says it prints."""
    text, found = _block(name)
    printed = re.search(r"```\n\nprints `(.*?)`", text[found.end() - 3 :]).group(1)
    script = readme_example(name, folder)
    completed = subprocess.run(
        [sys.executable, script.name],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env=example_env(),
        check=False,
    )
    return completed, printed
