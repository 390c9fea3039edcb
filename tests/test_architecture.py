"""The layout rules of docs/architecture.md, checked on the source itself.

Imports point downward only (no module imports one that imports it back, lazily or not;
the command line on top, then the run, then what it composes: planner, parallel, reports,
checkpoints, runtime), the runtime knows nothing of models or strategies, a strategy's
name appears in logic only inside its own package (the run, the command line and the
configuration ask the registry), and no function is longer than a screen.
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


CLI, RUN = "paratrain.cli", "paratrain.run"
ABOVE_PARTS = (CLI, RUN)  # the command line and the run: nothing they compose imports them


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("paratrain.run", (CLI,)),
        ("paratrain.reports", ABOVE_PARTS),
        ("paratrain.checkpoints", (*ABOVE_PARTS, "paratrain.reports")),
        ("paratrain.config", (*ABOVE_PARTS, "paratrain.reports", "paratrain.checkpoints")),
        ("paratrain.planner", ABOVE_PARTS),
        ("paratrain.api", ABOVE_PARTS),
        (
            "paratrain.runtime",
            (*ABOVE_PARTS, "paratrain.parallel", "paratrain.models", "paratrain.data"),
        ),
        ("paratrain.parallel", (*ABOVE_PARTS, "paratrain.config", "paratrain.reports")),
        ("paratrain.models", (*ABOVE_PARTS, "paratrain.parallel", "paratrain.runtime")),
    ],
)
def test_imports_point_downward(layer, forbidden):
    graph = import_graph()
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    )
    assert upward == []


def test_only_the_entry_point_imports_the_command_line():
    graph = import_graph()
    users = sorted(
        name
        for name, targets in graph.items()
        if not (name == CLI or name.startswith(CLI + "."))
        and any(t == CLI or t.startswith(CLI + ".") for t in targets)
    )
    assert users == ["paratrain.__main__"]


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


def files_in(*packages: str) -> list[str]:
    return sorted(
        str(p.relative_to(SOURCE)) for package in packages for p in (SOURCE / package).glob("*.py")
    )


@pytest.mark.parametrize("module", ["config.py", *files_in("run", "cli", "planner")])
def test_no_strategy_is_named_outside_its_package(module):
    named = sorted(words_in_logic(SOURCE / module) & set(strategy_names()))
    assert named == [], f"{module} names strategies {named}; ask the registry instead"


def test_the_name_finder_sees_names_in_code_and_strings(tmp_path):
    """Guards the previous test: a name in code or a message is found, one in a docstring not."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""About pipeline."""\nif strategy == "zero3":\n    use_ps = 1\n')
    assert {"zero3", "ps"} <= words_in_logic(sample)
    assert "pipeline" not in words_in_logic(sample)


MAX_FUNCTION_LINES = 80  # a screen: DESIGN.md's "a function longer than a screen is two"

# Longer functions allowed (none today): an entry whose function is gone or short again
# fails the test below, so the list only shrinks.
LONG_FUNCTIONS: set[str] = set()


def function_lengths(path: Path) -> dict[str, int]:
    """``Class.method`` or ``function`` -> its length in lines (decorators excluded),
    nested functions counted inside their enclosing one and on their own."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text()), "")
    return lengths


def long_functions() -> dict[str, int]:
    return {
        f"{path.relative_to(SOURCE)}:{name}": lines
        for path in sorted(SOURCE.rglob("*.py"))
        for name, lines in function_lengths(path).items()
        if lines > MAX_FUNCTION_LINES
    }


def test_no_function_is_longer_than_a_screen():
    found = long_functions()
    new = sorted(f"{name} ({lines} lines)" for name, lines in found.items())
    new = [entry for entry in new if entry.split(" (")[0] not in LONG_FUNCTIONS]
    assert new == [], f"split these into functions of at most {MAX_FUNCTION_LINES} lines"
    fixed = sorted(LONG_FUNCTIONS - set(found))
    assert fixed == [], "these are short now (or gone): drop them from LONG_FUNCTIONS"


def test_the_length_finder_measures_methods_and_nested_functions(tmp_path):
    """Guards the previous test against a finder that sees nothing."""
    sample = tmp_path / "sample.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(3))
    sample.write_text(
        f"class A:\n    def f(self):\n{body.replace('    ', '        ')}"
        f"def g():\n    def h():\n        pass\n{body}"
    )
    assert function_lengths(sample) == {"A.f": 4, "g": 6, "g.h": 2}
