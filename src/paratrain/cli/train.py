"""``paratrain train``: build the config, run it, print the summary."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from paratrain.cli.summary import format_summary
from paratrain.config import TrainConfig, build_config, load_toml
from paratrain.runtime.external_job import is_main_process
from paratrain.runtime.signals import EXIT_PREEMPTED


def train_command(args: argparse.Namespace) -> int:
    """``paratrain train``: the config from the file and flags (or the resumed run's), the
    run, its summary; the exit status says whether SIGTERM stopped it."""
    from paratrain.run.fit import fit
    from paratrain.run.resume_config import resume_config

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
