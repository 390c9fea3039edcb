"""``paratrain plan``: the planner's answer for a run, with every candidate and its fate.

Takes the flags ``paratrain train`` takes (the model, the data, ``--devices``,
``--global-batch``, ``--memory-per-device``, ``--precision``, any strategy option to fix)
and prints the choice, its predicted memory and step time, and the table of every
candidate. ``--strategy`` left out searches every strategy (``auto``); given, only it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from paratrain.config import AUTO, TrainConfig, build_config, load_toml
from paratrain.planner import NoPlanFits
from paratrain.planner.choose import format_table


def plan_command(args: argparse.Namespace) -> int:
    from paratrain.run.prepare import plan_run

    file_values = load_toml(args.config) if args.config else {}
    overrides = {item.name: getattr(args, item.name) for item in fields(TrainConfig)}
    if overrides.get("strategy") is None and file_values.get("strategy") is None:
        overrides["strategy"] = AUTO  # left out: every strategy
    config = build_config(file_values, overrides)
    try:
        planned, chosen, _ = plan_run(config)
    except NoPlanFits as error:
        devices = config.devices or _devices()
        print(format_table(error.candidates, devices, config.global_batch))
        print(f"paratrain: {error}", file=sys.stderr)
        return 1
    print(chosen.summary())
    print()
    print(chosen.table())
    flags = _flags(planned, chosen.strategy)
    print(f"\nto train with it: paratrain train {flags}")
    return 0


def _devices() -> int:
    from paratrain.runtime.launch import default_device_count

    return default_device_count()


def _flags(config: TrainConfig, strategy: str) -> str:
    """The train flags that reproduce the choice: the run's own, then the strategy's."""
    from paratrain.config import declared_option_names

    parts = [f"--model {config.model}", f"--dataset {config.dataset}", f"--strategy {strategy}"]
    defaults = TrainConfig()
    for name in ("devices", "global_batch", "gradient_accumulation", "precision"):
        value = getattr(config, name)
        if value is not None and value != getattr(defaults, name):
            parts.append(f"--{name.replace('_', '-')} {value}")
    for name in declared_option_names():
        value = getattr(config, name)
        if value != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)
