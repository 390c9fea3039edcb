"""The README's marked Python examples, taken from README.md itself so that the script a
user copies is the script the tests run (blocks marked ``<!-- readme-example: NAME -->``,
optionally followed by ``prints `LINE` `` after the block)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example_env() -> dict[str, str]:
    """The environment an example runs in: this checkout's paratrain importable."""
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def _block(name: str) -> tuple[str, re.Match]:
    text = (ROOT / "README.md").read_text()
    marker = rf"<!-- readme-example: {re.escape(name)} -->\n```python\n(.*?)```"
    found = re.search(marker, text, re.S)
    assert found, f"README.md lost its marked {name} example"
    return text, found


def readme_example(name: str, folder: Path) -> Path:
    """The marked example written to ``folder/name``, as printed."""
    _, found = _block(name)
    script = folder / name
    script.write_text(found.group(1))
    return script


def run_readme_example(name: str, folder: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run the marked example in ``folder``; its completed process and the line the
    README says it prints."""
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
