"""``paratrain plan``: the planner's answer for a run, with every candidate and its fate.

Takes the flags ``paratrain train`` takes (the model, the data, ``--devices``,
``--global-batch``, ``--memory-per-device``, ``--precision``, any strategy option to fix)
and prints the choice, its predicted memory and step time, and the table of every
candidate. ``--strategy`` left out searches every strategy (``auto``); given, only it.
What it measured is kept (``planner/cost_cache``, ``planner/machine``), so asking again
measures nothing; ``--refresh`` measures again.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from paratrain.cli.train_line import train_line
from paratrain.config import AUTO, ConfigError, TrainConfig, build_config, load_toml
from paratrain.planner import NoPlanFits
from paratrain.planner.choose import format_table


def plan_command(args: argparse.Namespace) -> int:
    from paratrain.run.prepare import plan_run

    file_values = load_toml(args.config) if args.config else {}
    if file_values.get("resume") is not None:
        raise ConfigError(
            "paratrain plan plans a fresh run, so its --config cannot name resume; leave it "
            "out (paratrain train --resume continues a run under any layout)."
        )
    overrides = {item.name: getattr(args, item.name, None) for item in fields(TrainConfig)}
    if overrides.get("strategy") is None and file_values.get("strategy") is None:
        overrides["strategy"] = AUTO  # left out: every strategy
    config = build_config(file_values, overrides)
    try:
        planned, chosen, _ = plan_run(config, refresh=args.refresh)
    except NoPlanFits as error:
        devices = config.devices or _devices()
        print(format_table(error.candidates, devices, config.global_batch))
        print(f"paratrain: {error}", file=sys.stderr)
        return 1
    print(chosen.summary())
    print()
    print(chosen.table())
    # Devices resolved: the run planned, whatever this machine's default is later.
    print(f"\nto train with it: {train_line(replace(planned, devices=chosen.devices))}")
    return 0


def _devices() -> int:
    from paratrain.runtime.launch import default_device_count

    return default_device_count()
