"""The layout rules of docs/architecture.md, checked on the source itself.

Imports point downward only (no module imports one that imports it back, lazily or not),
the runtime knows nothing of models or strategies, and a strategy's name appears in logic
only inside its own package: the trainer and the configuration ask the registry.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from paratrain.parallel import strategy_names

SOURCE = Path(__file__).resolve().parents[1] / "src" / "paratrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the paratrain modules it imports anywhere (top level, lazy, TYPE_CHECKING)."""
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [t if t in modules else node.module for t in targets]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a package's own submodules importing it (for its __init__) is no cycle
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    """Guards the next test against a finder that never reports anything."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("paratrain.runtime", ("paratrain.parallel", "paratrain.models", "paratrain.data")),
        ("paratrain.parallel", ("paratrain.run.fit", "paratrain.config", "paratrain.cli")),
        ("paratrain.models", ("paratrain.parallel", "paratrain.run.fit", "paratrain.runtime")),
    ],
)
def test_imports_point_downward(layer, forbidden):
    graph = import_graph()
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if target.startswith(forbidden)
    )
    assert upward == []


def words_in_logic(path: Path) -> set[str]:
    """Identifier parts and words of string literals, leaving out comments and docstrings."""
    source = path.read_text()
    docstrings = {
        node.body[0].value.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    words: set[str] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            words.update(token.string.split("_"))
        elif token.type == tokenize.STRING and token.start[0] not in docstrings:
            words.update(re.findall(r"[a-z0-9]+", token.string.lower()))
    return words


PLANNER = sorted(str(p.relative_to(SOURCE)) for p in (SOURCE / "planner").glob("*.py"))


@pytest.mark.parametrize(
    "module", ["trainer.py", "config.py", "cli.py", "auto_plan.py", "plan_cli.py", *PLANNER]
)
def test_no_strategy_is_named_outside_its_package(module):
    named = sorted(words_in_logic(SOURCE / module) & set(strategy_names()))
    assert named == [], f"{module} names strategies {named}; ask the registry instead"


def test_the_name_finder_sees_names_in_code_and_strings(tmp_path):
    """Guards the previous test: a name in code or a message is found, one in a docstring not."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""About pipeline."""\nif strategy == "zero3":\n    use_ps = 1\n')
    assert {"zero3", "ps"} <= words_in_logic(sample)
    assert "pipeline" not in words_in_logic(sample)
