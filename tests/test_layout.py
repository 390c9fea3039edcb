"""The Layout: the one place degrees are laid out and refused, and what reads it.

Pure: no worker starts. The refusal sentences are runtime/mesh.py's former ones, byte for
byte (they are what users saw before the Layout existed).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paratrain.parallel import Layout, LayoutError, strategy_class, strategy_names
from paratrain.parallel.pipeline.options import STAGES

SOURCE = Path(__file__).resolve().parents[1] / "src" / "paratrain"


def test_the_rest_of_the_devices_are_replicas():
    layout = Layout.over(8, stages=2, tensor=2)
    assert layout.as_tuple() == (2, 2, 2) and layout.devices == 8
    assert (layout.dp_enabled, layout.pp_enabled, layout.tp_enabled) == (True, True, True)
    assert layout.model_parallel == 4 and layout.virtual_stages == 1
    alone = Layout.over(3)
    assert alone.as_tuple() == (3, 1, 1) and not alone.pp_enabled and not alone.tp_enabled
    assert alone.record() == {"replicas": 3, "stages": 1, "tensor": 1}


@pytest.mark.parametrize(
    ("devices", "stages", "tensor", "sentence"),
    [
        (
            4,
            3,
            1,
            "3 pipeline stages do not divide 4 workers evenly; use a stage count among "
            "[1, 2, 4] or a multiple of 3 workers.",
        ),
        (
            4,
            1,
            3,
            "tensor=3 does not divide 4 workers into equal tensor groups; choose tensor among "
            "[1, 2, 4], or run on a multiple of 3 workers.",
        ),
        (
            6,
            2,
            2,
            "2 stages x tensor 2 = 4 workers per replica do not divide 6 workers; choose "
            "stages x tensor among [1, 2, 3, 6], or run on a multiple of 4 workers.",
        ),
        (4, 0, 1, "stages must be at least 1, not 0."),
        (4, 1, -1, "tensor must be at least 1, not -1."),
    ],
)
def test_degrees_that_do_not_fit_are_refused_with_what_would(devices, stages, tensor, sentence):
    with pytest.raises(LayoutError) as refused:
        Layout.over(devices, stages=stages, tensor=tensor)
    assert str(refused.value) == sentence


def test_a_layout_cannot_be_made_with_a_degree_below_one():
    with pytest.raises(LayoutError, match="replicas must be at least 1, not 0."):
        Layout(replicas=0)


def test_each_description_lays_out_its_own_defaults():
    """The defaults come from the declared options: pipeline's stage count, tp's tensor
    degree of every worker, zero3 and ps all replicas, single one device whatever the job."""
    pipeline = strategy_class("pipeline").layout(8, {})
    assert pipeline.as_tuple() == (8 // STAGES.default, STAGES.default, 1)
    assert strategy_class("tp").layout(4, {}).as_tuple() == (1, 1, 4)
    assert strategy_class("dp").layout(4, {"tensor": 2}).as_tuple() == (2, 1, 2)
    assert strategy_class("zero3").layout(4, {}).as_tuple() == (4, 1, 1)
    assert strategy_class("ps").layout(3, {}).as_tuple() == (3, 1, 1)
    assert strategy_class("single").layout(4, {}).as_tuple() == (1, 1, 1)


def test_every_strategy_is_a_description_naming_its_own_engine():
    engines = set()
    for name in strategy_names():
        description = strategy_class(name)
        assert description.name == description.engine.name == name
        assert description.engine.strategy is description
        engines.add(description.engine)
    assert len(engines) == len(strategy_names())  # no engine runs two strategies


def test_no_degree_is_read_from_an_options_dict_with_a_literal_default():
    """The degrees' defaults live in the option declarations and the Layout; a
    ``options.get("stages", 2)`` anywhere else would be a second source."""
    pattern = re.compile(r"""get\(\s*["'](stages|tensor|replicas)["']""")
    found = [
        f"{path.relative_to(SOURCE)}:{number}"
        for path in SOURCE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
