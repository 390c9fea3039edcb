"""The ``paratrain`` command line: ``paratrain train | plan | report | ckpt``.

``parser.py`` builds the parser (a flag per config field); each subcommand has its module
(``train.py``, ``plan.py``, ``report.py``, ``ckpt.py``); ``main`` dispatches and turns the
errors a user can act on into one line and an exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from paratrain.checkpoints.format import CheckpointError, CheckpointWriteError
from paratrain.cli.job_errors import say_error_once
from paratrain.cli.parser import build_parser
from paratrain.cli.report import report_command
from paratrain.cli.train import train_command
from paratrain.config import ConfigError
from paratrain.runtime.elastic import ElasticShortfall
from paratrain.runtime.launch import WorkerError
from paratrain.runtime.ledger import DeviceOutOfMemory
from paratrain.runtime.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED

__all__ = ["build_parser", "main"]


def _one_sentence(error: WorkerError) -> str | None:
    """The message of a worker's error that is one sentence for the user (out of memory,
    a checkpoint the disk refused), if that is what failed."""
    kinds = (DeviceOutOfMemory, CheckpointWriteError, ElasticShortfall)
    markers = [f"{kind.__name__}: " for kind in kinds]
    for line in reversed(error.details.splitlines()):
        for marker in markers:
            if marker in line:
                return line.split(marker, 1)[1]
    return None


def _quiet_stdout() -> None:
    """The reader of our output went away (``paratrain report RUN | head``): point stdout at
    /dev/null so the interpreter's last flush raises nothing, and end without a traceback
    (Python's documented recipe for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paratrain`` command."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train_command(args)
        if args.command == "report":
            return report_command(args)
        if args.command == "plan":
            from paratrain.cli.plan import plan_command

            return plan_command(args)
        if args.command == "ckpt":
            from paratrain.cli.ckpt import export_command, inspect_command
            from paratrain.cli.ckpt_import import import_command

            commands = {
                "inspect": inspect_command,
                "export": export_command,
                "import": import_command,
            }
            return commands[args.ckpt_command](args)
    except (ConfigError, CheckpointError) as error:
        say_error_once(error)  # under torchrun every rank refuses alike: said once
        return 2
    except WorkerError as error:
        if error.terminated:
            print(
                "paratrain: stopped by SIGTERM before the workers could write a checkpoint.",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        print(f"paratrain: {_one_sentence(error) or error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except KeyboardInterrupt:
        print("paratrain: interrupted; every worker was stopped.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 2
