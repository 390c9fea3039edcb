"""``paratrain train --help``: each default said once, choices listed, ``--version``.

The help once read ``(default: GPUs, else min(4, cores)) (default: None)``: the flag
builder appended the field's default to a help text that already said it. These tests
read every option's help as argparse prints it.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

import paratrain
from paratrain.cli import build_parser, main
from paratrain.config import TrainConfig
from paratrain.data import DATASETS


def train_parser() -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return commands.choices["train"]


def option_help() -> dict[str, str]:
    """Each ``--flag``'s help as printed (argparse's ``%`` formatting applied)."""
    parser = train_parser()
    formatter = parser._get_formatter()
    return {
        action.option_strings[0]: formatter._expand_help(action)
        for action in parser._actions
        if action.option_strings and action.help
    }


def test_no_option_says_its_default_twice() -> None:
    helps = option_help()
    assert len(helps) > len(fields(TrainConfig))  # every field, plus --help and --config
    twice = {flag: text for flag, text in helps.items() if text.count("default") > 1}
    assert twice == {}
    assert all("(default: None)" not in text for text in helps.values())
    # nor in other words: "(0 as torch.optim.SGD) (default: 0.0)" said the default twice
    assert helps["--momentum"] == "SGD momentum, as in torch.optim.SGD (default: 0.0)"


def test_every_default_that_is_a_value_is_said() -> None:
    helps = option_help()
    for item in fields(TrainConfig):
        if item.default is not None:
            assert "default" in helps["--" + item.name.replace("_", "-")], item.name


def test_choices_are_listed_and_every_dataset_is_among_them() -> None:
    text = train_parser().format_help()
    assert "--dataset {" + ",".join(DATASETS) + "}" in text
    for item in fields(TrainConfig):
        for choice in item.metadata.get("choices") or ():
            assert str(choice) in text, (item.name, choice)
    assert "--backend {auto,gloo,nccl}" in text and "--model {mlp,lenet,gpt}" in text


def test_data_dir_and_eval_batches_say_what_they_take() -> None:
    helps = option_help()
    assert "tinyshakespeare/input.txt" in helps["--data-dir"]
    assert "fashion_mnist/" in helps["--data-dir"]
    assert "a sample of N batches, or `all`" in helps["--eval-batches"]


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"paratrain {paratrain.__version__}"


def test_a_value_outside_the_choices_gets_the_one_line_refusal(tmp_path, capsys) -> None:
    """Choices are shown, not enforced by argparse (whose refusal is the usage and a
    second line): the run's own one-line refusal answers, as for a TOML file."""
    code = main(["train", "--model", "resnet", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "paratrain: error: unknown model 'resnet'; choose one of mlp, lenet, gpt.\n"
    )
