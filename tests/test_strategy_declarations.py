"""What each strategy declares about itself, asked of the class before any worker starts."""

from __future__ import annotations

import pytest

from paratrain.checkpoints.format import save_model_state
from paratrain.config import ConfigError, TrainConfig, build_config
from paratrain.parallel import RunSpec, declared_options, strategy_class, strategy_names
from paratrain.parallel.fit_advice import ranked_strategies
from paratrain.parallel.options import StrategyOption
from paratrain.parallel.strategy import engine_options
from paratrain.run.build import meta_model_once
from paratrain.run.preflight import check_config, check_model
from paratrain.run.resume_config import resume_config


@pytest.mark.parametrize("name", strategy_names())
def test_every_declared_option_is_a_keyword_of_the_engine(name):
    cls = strategy_class(name)
    declared = [option.name for option in cls.options]
    assert set(declared) <= set(engine_options(cls.engine)), name
    assert len(declared) == len(set(declared)), name


def test_every_declared_option_is_a_config_field_and_a_flag():
    config = TrainConfig()
    for name, (option, users) in declared_options().items():
        assert getattr(config, name) == option.default
        assert users == sorted(users) and users


def test_shared_options_must_mean_the_same_everywhere():
    assert declared_options()["bucket_mb"][1] == ["dp", "pipeline", "tp", "zero1", "zero2"]
    assert declared_options()["tensor"][1] == ["dp", "pipeline", "tp", "zero1", "zero2"]
    assert "recompute" in {o.name for o in strategy_class("zero3").options}


def test_an_option_of_another_strategy_is_refused():
    with pytest.raises(ConfigError, match=r"--stages is a pipeline option; pass --strategy pipe"):
        TrainConfig(strategy="dp", stages=4)
    with pytest.raises(ConfigError, match=r"--servers is a ps option"):
        TrainConfig(strategy="zero1", servers=2)
    with pytest.raises(
        ConfigError, match=r"--bucket-mb is a dp, pipeline, tp, zero1, zero2 option"
    ):
        TrainConfig(strategy="zero3", bucket_mb=1.0)
    with pytest.raises(ConfigError, match=r"--tensor is a dp, pipeline, tp, zero1, zero2 option"):
        TrainConfig(strategy="zero3", tensor=2)
    assert TrainConfig(strategy="dp", stages=2).strategy == "dp", "the default is no choice"


def test_a_flag_given_at_its_default_for_another_strategy_is_refused(tmp_path):
    """``--stages 2 --strategy dp`` asks for two stages; dp trained without them (2 is the
    default, which is all ``TrainConfig`` can see). A flag the user gave is refused, on a
    new run or a resume; a switch turned off asks for nothing, and a TOML file may hold
    every key at its default (a config copied from metrics.jsonl does)."""
    with pytest.raises(ConfigError, match=r"^--stages is a pipeline option; pass --strategy"):
        build_config({}, {"strategy": "dp", "stages": "2"})
    with pytest.raises(ConfigError, match=r"^--staleness is a ps option"):
        build_config({}, {"strategy": "dp", "staleness": "0"})
    assert build_config({"servers": 1, "stages": 2}, {"strategy": "zero1"}).servers == 1
    assert build_config({}, {"strategy": "ps", "stages": None, "recompute": False}).servers == 1
    assert build_config({}, {"strategy": "pipeline", "stages": "2"}).stages == 2
    saved = save_model_state(tmp_path / "run" / "final", {}, metadata={"config": {}})
    with pytest.raises(ConfigError, match=r"^--schedule is a pipeline option"):
        resume_config({}, {"resume": str(saved), "strategy": "dp", "schedule": "1f1b"})


def test_option_values_are_checked_as_declared():
    with pytest.raises(
        ConfigError, match="schedule must be one of gpipe, 1f1b, zb-h1, zb-h2, not 'zig"
    ):
        TrainConfig(strategy="pipeline", schedule="zigzag")
    with pytest.raises(ConfigError, match="balance_by must be one of params, time, memory"):
        TrainConfig(strategy="pipeline", balance_by="flops")
    with pytest.raises(ConfigError, match="balance must be comma-separated"):
        TrainConfig(strategy="pipeline", balance="2;2")
    with pytest.raises(ConfigError, match="bucket_mb must be positive, not 0"):
        TrainConfig(strategy="dp", bucket_mb=0.0)
    with pytest.raises(ConfigError, match="micro_batches must be at least 1, not 0"):
        TrainConfig(strategy="pipeline", micro_batches=0)
    options = TrainConfig(strategy="pipeline", balance="1,3").strategy_options()
    assert options["balance"] == [1, 3] and options["micro_batches"] is None


def test_an_option_declaration_checks_and_converts():
    option = StrategyOption("k", int, 1, "help", minimum=1, parse=lambda v: v * 10)
    option.check(2)
    assert option.engine_value(2) == 20
    with pytest.raises(ValueError, match="k must be at least 1, not 0"):
        option.check(0)


@pytest.mark.parametrize(
    ("strategy", "options", "devices", "message"),
    [
        ("single", {}, 2, "strategy 'single' trains on one device"),
        ("pipeline", {"stages": 3}, 4, "3 pipeline stages do not divide 4 workers"),
        ("pipeline", {"stages": 2, "micro_batches": 3}, 2, "micro-batch"),
        ("dp", {}, 3, "3 replica(s)"),
        ("ps", {"straggler": {"rank": 5, "slowdown": 2.0}}, 2, "names worker 5"),
    ],
)
def test_check_run_refuses_what_cannot_work(strategy, options, devices, message):
    run = RunSpec(devices=devices, global_batch=32, options=options)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        strategy_class(strategy).check_run(run)


def test_pipeline_checks_its_stages_against_the_models_layers():
    """An mlp of one hidden layer is 4 layers (flatten, linear, relu, linear): not 8 stages."""
    config = TrainConfig(
        model="mlp", strategy="pipeline", devices=8, stages=8, global_batch=32, depth=1
    )

    class Bundle:  # what model_options reads of a dataset
        num_classes, input_shape, train = 10, (784,), None

    assert check_config(config) == 8, "without the dataset the layers are not counted yet"
    with pytest.raises(ConfigError, match="8 stages"):
        check_model(config, 8, Bundle(), meta_model_once(config, Bundle()))


def test_advice_ranks_strategies_from_their_declarations():
    assert ranked_strategies() == ["dp", "zero1", "zero2", "zero3", "pipeline"]
    assert strategy_class("zero2").model_state_per_worker(100, 4, {}) == (4 + 12 / 4) * 100
    assert strategy_class("pipeline").model_state_per_worker(100, 4, {"stages": 2}) == 800
    assert strategy_class("ps").model_state_per_worker(100, 4, {}) is None
