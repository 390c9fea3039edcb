"""The command line's smaller rough edges (issue 24, item 11): each subcommand's help shows
its own flags and defaults, and a closed pipe ends the output without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain
from paratrain.cli import build_parser

SOURCE = Path(paratrain.__file__).resolve().parents[1]  # the paratrain under test
ROOT = Path(__file__).resolve().parents[1]


def _help_text(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


def test_ckpt_import_help_has_no_empty_strategy_group(capsys):
    text = _help_text(capsys, "ckpt", "import")
    assert "--n-embd" in text  # the model flags it does take
    assert "strategy options" not in text


def test_plan_help_is_plans_own(capsys):
    """plan defaults to auto (train to dp); the flags only the train line uses are set
    apart; --resume, which a plan cannot honour, is not offered."""
    text = _help_text(capsys, "plan")
    assert "the strategy to plan (default: auto" in text
    assert "(default: dp)" not in text
    assert "--resume" not in text
    planned, carried = text.split("options: -h, --help")[1].split("the run's other settings:")
    assert "--steps" in carried and "--lr " in carried and "--memory-per-device" not in carried
    assert "--steps" not in planned and "--memory-per-device" in planned


def test_train_help_keeps_every_flag(capsys):
    text = _help_text(capsys, "train")
    assert "--resume" in text and "strategy options" in text and "(default: dp)" in text


def test_a_closed_pipe_ends_quietly():
    """``paratrain report RUN | head``: the reader leaves after one line; the command must
    not print a BrokenPipeError traceback (the report stands in for any long output)."""
    script = (
        "import paratrain.cli as cli\n"
        "def long_report(args):\n"
        "    for n in range(200000):\n"
        "        print('line', n)\n"
        "    return 0\n"
        "cli.report_command = long_report\n"
        "raise SystemExit(cli.main(['report', 'RUN']))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{ROOT}"}
    writer = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert writer.stdout is not None and writer.stderr is not None
    assert writer.stdout.readline() == b"line 0\n"
    writer.stdout.close()  # as head does after its lines
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=60) == 1
    assert err == "", err


def test_plan_refuses_a_resume_from_its_config_file(tmp_path, capsys):
    """--resume is no plan flag; a run file that names one gets a sentence, not silence."""
    from paratrain.cli import main

    run_file = tmp_path / "run.toml"
    run_file.write_text('model = "mlp"\nresume = "/nonexistent"\n')
    assert main(["plan", "--config", str(run_file)]) == 2
    assert capsys.readouterr().err == (
        "paratrain: error: paratrain plan plans a fresh run, so its --config cannot name "
        "resume; leave it out (paratrain train --resume continues a run under any layout).\n"
    )
