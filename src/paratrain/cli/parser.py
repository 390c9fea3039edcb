"""The ``paratrain`` argument parser: its subcommands and a flag per config field.

Every TrainConfig field is a ``--flag`` (underscores become dashes) and a key of the
``--config run.toml`` file; flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields

from paratrain import __version__
from paratrain.config import TrainConfig, field_types
from paratrain.run.resume_config import MODEL_FIELDS

PLAN_FIELDS = (
    "model",
    "dataset",
    "strategy",
    "devices",
    "global_batch",
    "gradient_accumulation",
    "optimizer",
    "momentum",
    "max_grad_norm",
    *MODEL_FIELDS[2:],  # the model's own sizes (after "model" and "dataset", named above)
    "precision",
    "memory_per_device",
    "data_dir",
    "backend",
)
"""What ``paratrain plan`` measures and predicts with (besides every strategy option)."""

PLAN_REFUSES = ("resume",)
"""Train flags ``paratrain plan`` does not take: it plans a fresh run."""

PLAN_STRATEGY_HELP = (
    "the strategy to plan (default: auto, every strategy; name one to plan only its layouts)"
)


def _add_config_flags(
    parser: argparse.ArgumentParser,
    only: Sequence[str] | None = None,
    *,
    carried: Sequence[str] = (),
    helps: dict[str, str] | None = None,
) -> None:
    """A flag per TrainConfig field (or per field named in ``only``); the strategies' own
    options in a group of their own (none where no such option is chosen); the fields in
    ``carried`` in a group that says they only pass on to the printed train line;
    ``helps`` replaces a field's help (``plan``'s own --strategy default)."""
    kinds = field_types()
    chosen = [item for item in fields(TrainConfig) if only is None or item.name in only]
    strategy_group = None
    if any(item.metadata.get("strategies") for item in chosen):
        strategy_group = parser.add_argument_group(
            "strategy options", "each applies to the strategies named in its help"
        )
    carried_group = None
    if carried:
        carried_group = parser.add_argument_group(
            "the run's other settings",
            "not used by the plan; carried into its `to train with it` line",
        )
    for item in chosen:
        if item.metadata.get("strategies"):
            target = strategy_group
        elif item.name in carried:
            target = carried_group
        else:
            target = parser
        flag = "--" + item.name.replace("_", "-")
        if helps and item.name in helps:
            help_text = helps[item.name]
        else:
            help_text = flag_help(item, is_bool=kinds[item.name] is bool)
        if kinds[item.name] is bool:
            target.add_argument(
                flag,
                dest=item.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            # Choices are shown, not enforced, here: a value outside them gets the same
            # one-line refusal from the config or the trainer as one from a TOML file.
            choices = item.metadata.get("choices")
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else item.name.upper()
            target.add_argument(flag, dest=item.name, default=None, metavar=metavar, help=help_text)


def flag_help(item: Field, *, is_bool: bool) -> str:
    """A field's help with its default said once.

    The default is read from the field, except where the help already says it (``(default:
    ...)``, for a default that depends on the machine, or a None that means something), and
    not said for a None the help leaves unexplained. The parser's own formatter adds no
    default (it is a plain ``HelpFormatter``), so nothing is said twice.
    """
    text = item.metadata.get("help", "").replace("%", "%%")  # argparse formats % itself
    default = item.default if item.default is not MISSING else None
    if "(default" in text or default is None:
        return text
    if is_bool:
        default = ("--" if default else "--no-") + item.name.replace("_", "-")
    return f"{text} (default: {default})"


def _is_option(name: str) -> bool:
    """Whether ``name`` is a strategy's own option (planned with, in its own group)."""
    return any(
        item.name == name and item.metadata.get("strategies") for item in fields(TrainConfig)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Train one PyTorch model on several devices."
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a reference model on local workers")
    train.add_argument("--config", default=None, help="TOML file of TrainConfig keys")
    _add_config_flags(train)
    plan = commands.add_parser(
        "plan",
        help="predict how to split a run over the devices: the fastest layout predicted to fit "
        "--memory-per-device, and every candidate with its memory, time and verdict",
    )
    plan.add_argument("--config", default=None, help="TOML file of TrainConfig keys")
    plan.add_argument(
        "--refresh",
        action="store_true",
        help="measure the model and this machine's collectives again instead of reading "
        "what an earlier plan measured (kept under $PARATRAIN_CACHE, default "
        "~/.cache/paratrain)",
    )
    everything = [item.name for item in fields(TrainConfig) if item.name not in PLAN_REFUSES]
    _add_config_flags(
        plan,
        only=everything,
        carried=[name for name in everything if name not in PLAN_FIELDS and not _is_option(name)],
        helps={"strategy": PLAN_STRATEGY_HELP},
    )
    report = commands.add_parser(
        "report",
        help="summarise a run and draw report.png (and its timeline where it recorded one); "
        "with several runs, overlay them and print a table",
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="a run's folder (holds metrics.jsonl)"
    )
    report.add_argument(
        "--out",
        default=None,
        help="where to write pictures (default: the run's folder; for several runs, the "
        "current folder, as compare.png)",
    )
    ckpt = commands.add_parser("ckpt", help="look into or convert a checkpoint")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser("inspect", help="verify a checkpoint and list its contents")
    inspect.add_argument("path", help="a checkpoint folder (or a run folder: its newest)")
    export = ckpt_commands.add_parser(
        "export",
        help="write the model as one plain state-dict file (.safetensors or .pt), a Hugging "
        "Face folder (--format hf) or a PyTorch distributed checkpoint (--format dcp)",
    )
    export.add_argument("path", help="a checkpoint folder (or a run folder: its newest)")
    export.add_argument(
        "out", help="output file (model.safetensors, model.pt) or, with --format, a new folder"
    )
    from paratrain.cli.ckpt_formats import add_format_flags

    add_format_flags(export)
    imported = ckpt_commands.add_parser(
        "import",
        help="make a paratrain checkpoint of weights saved elsewhere (a DCP folder's optimizer "
        "state too), to --resume",
    )
    imported.add_argument(
        "source",
        help="a .pt/.pth/.bin state dict, a .safetensors file, a checkpoint folder, or a "
        "PyTorch distributed checkpoint (DCP) folder",
    )
    imported.add_argument("out", help="the checkpoint folder to write")
    from paratrain.cli.ckpt_import import IMPORT_FIELDS

    _add_config_flags(imported, only=IMPORT_FIELDS)
    return parser
