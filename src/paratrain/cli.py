"""The ``paratrain`` command line: ``paratrain train ...``.

Every TrainConfig field is a ``--flag`` (underscores become dashes) and a key of the
``--config run.toml`` file; flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path

from paratrain import __version__
from paratrain.checkpoint import CheckpointError
from paratrain.config import ConfigError, TrainConfig, build_config, field_types, load_toml
from paratrain.parallel import strategy_class, strategy_names
from paratrain.parallel.strategy import TIMELINE_FILE, RecordsTimeline
from paratrain.report import format_bytes
from paratrain.report_compare import compare_rows, format_compare
from paratrain.report_data import RunMetrics, load_run
from paratrain.report_plot import draw_runs
from paratrain.report_text import summarize_run
from paratrain.runtime.external_job import is_main_process
from paratrain.runtime.launch import WorkerError
from paratrain.runtime.ledger import DeviceOutOfMemory
from paratrain.runtime.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED


def _add_config_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """A flag per TrainConfig field (or per field named in ``only``); the strategies' own
    options in a group of their own."""
    kinds = field_types()
    strategy_group = parser.add_argument_group(
        "strategy options", "each applies to the strategies named in its help"
    )
    for item in fields(TrainConfig):
        if only is not None and item.name not in only:
            continue
        target = strategy_group if item.metadata.get("strategies") else parser
        flag = "--" + item.name.replace("_", "-")
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
    _add_config_flags(plan)
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
    from paratrain.checkpoint_formats import add_format_flags

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
    from paratrain.checkpoint_import import IMPORT_FIELDS

    _add_config_flags(imported, only=IMPORT_FIELDS)
    return parser


def _per_worker(label: str, values: list) -> list[str]:
    """One summary line of per-worker byte counts; none where the engine does not measure it."""
    if any(value is None for value in values):
        return []
    joined = ", ".join(f"worker {rank}: {format_bytes(value)}" for rank, value in enumerate(values))
    return [f"  {label:<18}{joined}"]


def _strategy_lines(result) -> list[str]:
    """What the run's strategy reports of itself, then any worker the run lost."""
    strategy = result.config.strategy
    metrics = result.extra.get(strategy)
    lines = strategy_class(strategy).summary_lines(metrics) if metrics else []
    for rank, reason in sorted(result.extra.get("lost_workers", {}).items()):
        lines.append(f"  lost worker       {rank}: {reason}")
    return lines


def _peak(record: dict, category: str) -> int | None:
    """A category's peak in a ledger record; None where the engine never measured it."""
    return record.get("peak", {}).get(category)


def _out_of_memory(error: WorkerError) -> str | None:
    """The one-sentence message of a worker's ``DeviceOutOfMemory``, if that is what failed."""
    marker = f"{DeviceOutOfMemory.__name__}: "
    for line in reversed(error.details.splitlines()):
        if marker in line:
            return line.split(marker, 1)[1]
    return None


def _steps_run(result) -> str:
    """``100 steps``, or for a run SIGTERM stopped early, how far of how many it got
    (the configured length alone would claim steps that never ran)."""
    if result.preempted_at is None:
        return f"{result.steps} steps"
    return f"{result.preempted_at} of {result.steps} steps (stopped by SIGTERM)"


def format_summary(result) -> str:
    """The closing summary a user reads after ``paratrain train``."""
    config = result.config
    lines = [
        f"paratrain train: {config.model} on {config.dataset}, strategy {config.strategy}, "
        f"{result.devices} worker(s), {_steps_run(result)}"
        + (f" ({config.epochs} epoch{'s' * (config.epochs > 1)})" if config.epochs else "")
        + f", global batch {config.global_batch}",
        f"  final train loss  {result.final_train_loss:.4f}",
    ]
    if result.resumed:
        lines.insert(1, f"  resumed {result.resumed}")
    if result.final_eval_loss is not None:
        lines.append(f"  final eval loss   {result.final_eval_loss:.4f}")
    if result.final_accuracy is not None:
        lines.append(f"  final accuracy    {100 * result.final_accuracy:.2f}%")
    lines.append(f"  throughput        {result.samples_per_s:,.1f} samples/s")
    if config.precision != "fp32":
        lines.append(f"  precision         {config.precision}")
    if config.precision == "fp16":
        lines.append(
            f"  skipped steps     {result.skipped_steps} (inf/NaN gradients; "
            f"loss scale now {result.loss_scale:g})"
        )
    lines += _per_worker("peak memory", result.peak_memory_bytes)
    lines += _per_worker("parameters held", result.parameter_bytes)
    lines += _per_worker("gradients held", [m["gradients"] for m in result.model_state_bytes])
    lines += _per_worker("optimizer state", [m["optimizer"] for m in result.model_state_bytes])
    lines += _per_worker("activations peak", result.activation_peak_bytes)
    lines += _per_worker("comm buffers peak", [_peak(m, "communication") for m in result.memory])
    lines += _per_worker("ledger peak", [m.get("peak_total") for m in result.memory])
    if result.plan is not None:
        from paratrain.auto_plan import measured_lines

        peaks = [m.get("peak_total") for m in result.memory]
        lines += measured_lines(result.plan, peaks, result.samples_per_s)
    if result.memory and result.memory[0].get("budget") is not None:
        lines.append(f"  memory budget     {format_bytes(result.memory[0]['budget'])} per worker")
    lines += _strategy_lines(result)
    lines += [f"  checkpoint        {result.checkpoint}", f"  metrics           {result.metrics}"]
    if result.sample_text is not None:
        lines += ["  sample:", *("    " + line for line in result.sample_text.splitlines())]
    return "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    from paratrain.resume_config import resume_config
    from paratrain.trainer import fit

    file_values = load_toml(args.config) if args.config else {}
    overrides = {item.name: getattr(args, item.name) for item in fields(TrainConfig)}
    if overrides.get("resume") is None and file_values.get("resume") is None:
        config = build_config(file_values, overrides)
    else:  # the checkpoint's settings, then what the user may change
        config = resume_config(file_values, overrides, config_file=args.config)
    try:
        result = fit(config)
    except KeyboardInterrupt:
        if config.progress:  # the bar's last line has no end: the one line starts its own
            print(file=sys.stderr)
        raise
    if not is_main_process():  # under torchrun every rank gets here; one summary is enough
        return EXIT_PREEMPTED if result.preempted_at is not None else 0
    print(format_summary(result))
    if result.preempted_at is None:
        return 0
    print(
        f"paratrain: stopped by SIGTERM after step {result.preempted_at}; checkpoint "
        f"{result.checkpoint}. Resume with: paratrain train --resume {result.run_dir}",
        file=sys.stderr,
    )
    return EXIT_PREEMPTED


def _report(args: argparse.Namespace) -> int:
    run_dirs = [Path(d) for d in args.run_dirs]
    if len(run_dirs) > 1:
        return _compare([_load(d) for d in run_dirs], args.out)
    run_dir = run_dirs[0]
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists() and not (run_dir / TIMELINE_FILE).exists():
        raise ConfigError(f"{run_dir} holds no metrics.jsonl; pass the folder of a paratrain run.")
    strategy = None
    if metrics_file.exists():
        run = load_run(run_dir)
        strategy = run.config.get("strategy")
        print(summarize_run(run))
        picture = Path(args.out or run_dir) / "report.png"
        draw_runs([run], picture)
        print(f"  {'report':<20}{picture}")
    if (run_dir / TIMELINE_FILE).exists():
        recorder = _timeline_recorder(strategy)
        try:  # a timeline that cannot be read is refused with the reader's sentence
            print(recorder.summarize_timeline(run_dir))
            drawn = recorder.report_timeline(run_dir, out_dir=args.out)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for kind, path in drawn.items():
            print(f"  {kind:<20}{path}")
    return 0


def _load(run_dir: Path) -> RunMetrics:
    try:
        return load_run(run_dir)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None


def _compare(runs: list[RunMetrics], out: str | None) -> int:
    """Several runs: one table of headline figures, one picture with the runs overlaid."""
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # legends and table rows name runs by folder
        runs = [replace(run, display_name=str(run.run_dir)) for run in runs]
    print(format_compare(compare_rows(runs)))
    picture = Path(out or ".") / "compare.png"
    draw_runs(runs, picture)
    print(f"  {'report':<20}{picture}")
    return 0


def _timeline_recorder(strategy: str | None):
    """The engine class that draws a run's timeline: the run's own strategy where it
    records one, else the first registered strategy that does."""
    recorders = [
        strategy_class(name)
        for name in strategy_names()
        if issubclass(strategy_class(name), RecordsTimeline)
    ]
    by_name = {cls.name: cls for cls in recorders}
    return by_name.get(strategy, recorders[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paratrain`` command."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "report":
            return _report(args)
        if args.command == "plan":
            from paratrain.plan_cli import plan_command

            return plan_command(args)
        if args.command == "ckpt":
            from paratrain.checkpoint_cli import export_command, inspect_command
            from paratrain.checkpoint_import import import_command

            commands = {
                "inspect": inspect_command,
                "export": export_command,
                "import": import_command,
            }
            return commands[args.ckpt_command](args)
    except (ConfigError, CheckpointError) as error:
        print(f"paratrain: error: {error}", file=sys.stderr)
        return 2
    except WorkerError as error:
        if error.terminated:
            print(
                "paratrain: stopped by SIGTERM before the workers could write a checkpoint.",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        print(f"paratrain: {_out_of_memory(error) or error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("paratrain: interrupted; every worker was stopped.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 2


if __name__ == "__main__":
    sys.exit(main())
