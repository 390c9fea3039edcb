"""The run is prepared once in the parent: one check path, the meta model built once."""

from __future__ import annotations

import pytest

import paratrain.run.build as build
from paratrain.config import ConfigError, TrainConfig
from paratrain.run.prepare import prepare_run


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Every model the run's builders make, by device ("meta" for the parent's checks)."""
    made: list[str] = []
    real = build.build_model

    def counted(name, **options):
        model = real(name, **options)
        made.append(next(model.parameters()).device.type)
        return model

    monkeypatch.setattr(build, "build_model", counted)
    return made


def test_the_strategy_and_the_memory_check_share_one_meta_model(builds):
    """The pipeline's check_run and the budget check both read the model (they built two
    before the run was prepared in one place)."""
    config = TrainConfig(
        model="mlp", dataset="synthetic", strategy="pipeline", devices=2, memory_per_device="1GiB"
    )
    run = prepare_run(config)
    assert builds == ["meta"]
    assert run.config is config and run.devices == 2 and run.plan is None


def test_every_run_builds_the_meta_model_once_to_check_the_model_options(builds):
    """Even where no strategy check reads the model: building it is how an option the
    builder refuses (--n-embd 66 with 4 heads) is refused before launch (issue 24, 6)."""
    prepare_run(TrainConfig(model="mlp", dataset="synthetic", strategy="dp", devices=2))
    assert builds == ["meta"]


def test_a_budget_the_parameters_exceed_is_refused_in_one_sentence(builds):
    config = TrainConfig(model="mlp", dataset="synthetic", devices=2, memory_per_device="1KiB")
    with pytest.raises(ConfigError, match="the parameters alone need .* per worker"):
        prepare_run(config)
    assert builds == ["meta"]
