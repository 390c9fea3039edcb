"""TrainConfig: TOML loading, command-line overrides, and refusals of bad keys and values."""

from __future__ import annotations

import pytest

from paratrain.config import ConfigError, TrainConfig, build_config, coerce, load_toml


def test_defaults_then_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\nsteps = 50\nlr = 1\nprogress = false\n')
    values = load_toml(path)
    config = build_config(values, {"steps": "70", "devices": None})
    assert config.model == "mlp"
    assert config.steps == 70  # the command line wins
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.progress is False
    assert config.strategy == TrainConfig().strategy  # untouched default


def test_unknown_key_in_file_is_refused_with_the_known_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("lrr = 0.1\n")
    with pytest.raises(ConfigError) as caught:
        load_toml(path)
    message = str(caught.value)
    assert "unknown key(s) lrr" in message and str(path) in message and "lr," in message


def test_wrong_types_and_values_are_refused():
    with pytest.raises(ConfigError, match="steps must be an integer, not 'ten'"):
        build_config({}, {"steps": "ten"})
    with pytest.raises(ConfigError, match="steps must be an integer, not 1.5"):
        build_config({"steps": 1.5})
    with pytest.raises(ConfigError, match="steps must be at least 1"):
        build_config({"steps": 0})
    with pytest.raises(ConfigError, match="optimizer must be sgd, adam or adamw"):
        build_config({"optimizer": "lion"})
    with pytest.raises(ConfigError, match="progress must be true or false"):
        coerce("progress", "maybe", bool)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(broken)
