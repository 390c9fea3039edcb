"""The ``paratrain`` command line: ``paratrain train ...``.

Every TrainConfig field is a ``--flag`` (underscores become dashes) and a key of the
``--config run.toml`` file; flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields

from paratrain.config import ConfigError, TrainConfig, build_config, field_types, load_toml
from paratrain.runtime.launch import WorkerError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    kinds = field_types()
    for item in fields(TrainConfig):
        flag = "--" + item.name.replace("_", "-")
        default = item.default if item.default is not MISSING else None
        help_text = f"{item.metadata.get('help', '')} (default: {default})"
        if kinds[item.name] is bool:
            parser.add_argument(
                flag,
                dest=item.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=item.name, default=None, metavar=item.name.upper(), help=help_text
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Train one PyTorch model on several devices."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a reference model on local workers")
    train.add_argument("--config", default=None, help="TOML file of TrainConfig keys")
    _add_config_flags(train)
    return parser


def _mib(count: int) -> str:
    return f"{count / 2**20:,.0f} MiB"


def format_summary(result) -> str:
    """The closing summary a user reads after ``paratrain train``."""
    config = result.config
    lines = [
        f"paratrain train: {config.model} on {config.dataset}, strategy {config.strategy}, "
        f"{result.devices} worker(s), {config.steps} steps, global batch {config.global_batch}",
        f"  final train loss  {result.final_train_loss:.4f}",
    ]
    if result.final_eval_loss is not None:
        lines.append(f"  final eval loss   {result.final_eval_loss:.4f}")
    lines += [
        f"  throughput        {result.samples_per_s:,.1f} samples/s",
        "  peak memory       "
        + ", ".join(f"worker {r}: {_mib(b)}" for r, b in enumerate(result.peak_memory_bytes)),
        f"  checkpoint        {result.checkpoint}",
        f"  metrics           {result.metrics}",
    ]
    if result.sample_text is not None:
        lines += ["  sample:", *("    " + line for line in result.sample_text.splitlines())]
    return "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    from paratrain.trainer import fit

    file_values = load_toml(args.config) if args.config else {}
    overrides = {item.name: getattr(args, item.name) for item in fields(TrainConfig)}
    config = build_config(file_values, overrides)
    result = fit(config)
    print(format_summary(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paratrain`` command."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
    except ConfigError as error:
        print(f"paratrain: error: {error}", file=sys.stderr)
        return 2
    except WorkerError as error:
        print(f"paratrain: {error}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
