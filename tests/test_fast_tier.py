"""The quick tier's lists in tests/conftest.py name files and tests that exist, so that a
renamed test or file cannot silently drop out of `make test-fast`."""

from __future__ import annotations

import ast

import pytest

from tests import conftest
from tests.readme_examples import ROOT


def functions_of(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("path", conftest.FAST_FILES)
def test_every_fast_file_exists(path):
    assert (ROOT / path).is_file(), f"{path} is in FAST_FILES but no such file"


@pytest.mark.parametrize("entry", conftest.FAST_TESTS + conftest.NOT_FAST)
def test_every_named_test_is_defined(entry):
    path, name = entry.split("::")
    assert name.split("[")[0] in functions_of(path), f"{entry} names no test of {path}"


def test_every_not_fast_test_is_in_a_fast_file():
    assert {entry.split("::")[0] for entry in conftest.NOT_FAST} <= set(conftest.FAST_FILES)


def test_the_tier_takes_a_files_quick_tests_and_the_named_ones_only():
    """Guards the selection rule on stand-in items."""

    class Item:
        def __init__(self, nodeid, *markers):
            self.nodeid, self.keywords = nodeid, set(markers)

    assert conftest.is_fast(Item("tests/test_config.py::test_anything"))
    assert not conftest.is_fast(Item("tests/test_config.py::test_anything", "slow"))
    assert not conftest.is_fast(Item("tests/test_hang.py::test_anything"))
    assert conftest.is_fast(Item(conftest.FAST_TESTS[1], "slow"))
    assert not conftest.is_fast(Item("tests/test_parity_dp.py::test_dp_matches_single_device[4]"))
    assert not conftest.is_fast(Item(conftest.NOT_FAST[0] + "[mlp-synthetic]"))
