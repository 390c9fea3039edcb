"""A resume's settings: the checkpoint's saved config, then what the user may change.

``paratrain train --resume RUN --steps 50`` must train the model the checkpoint holds, on
the data and with the optimizer it was trained with, without the user retyping every
flag (and without a worker failing on ``size of tensor a (128) must match ... (64)`` when
they do not). The trainer saves its whole config in every checkpoint's metadata, so the
settings are: the saved config (less what says where this run is), then the TOML file,
then the flags the user passed.

A flag that contradicts a ``FIXED`` setting is refused before any worker starts, because
the checkpoint cannot honour it: the weights have the saved model's shapes, the optimizer
state overwrites lr, momentum and weight decay with its saved values (a new value would be
silently ignored), and the loader's saved position counts batches of the saved size in
the saved seed's order. Everything else (steps, devices, the strategy and its options,
precision, checkpointing, evaluation, logging, ...) may change; a field added later is in
this group unless it is added to ``FIXED``.

A checkpoint made by ``paratrain ckpt import`` saves only the model's settings: the
optimizer and data settings then come from the command line, as for a new run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.checkpoints.format import read_manifest
from paratrain.checkpoints.locate import find_checkpoint
from paratrain.config import (
    ConfigError,
    TrainConfig,
    coerce,
    field_types,
    refuse_foreign_flags,
)
from paratrain.parallel import declared_options

MODEL_FIELDS = (
    "model",
    "dataset",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "tie_embeddings",
    "hidden",
    "depth",
)
"""What the saved weights' names and shapes follow (the dataset gives vocabulary, input
size and classes)."""

OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "weight_decay")
"""What the saved optimizer state carries: its kind's state keys and its hyperparameters,
which loading the state puts back over whatever the config says."""

DATA_FIELDS = ("global_batch", "seed")
"""What the saved loader position means (batches of this size, in this seed's order; the
seed also generates the synthetic datasets)."""

FIXED = MODEL_FIELDS + OPTIMIZER_FIELDS + DATA_FIELDS

NOT_INHERITED = ("resume", "run_dir", "overwrite")
"""Where this run is: the checkpoint named now, and (unless given) the checkpoint's run
folder, wherever it has been moved to; and whether this run may replace one there."""


def saved_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """The config a paratrain run saved in the checkpoint's manifest; None where the
    checkpoint was written by other code (``engine.save_checkpoint`` with user metadata)."""
    config = read_manifest(checkpoint).get("metadata", {}).get("config")
    return config if isinstance(config, dict) else None


def _flag(name: str, value: Any, source: str) -> tuple[str, str]:
    """How the user gave a setting, and how to take it back: (``--n-embd 64``, ``drop
    --n-embd``), or (``n_embd = 64 in run.toml``, ``remove n_embd from run.toml``)."""
    if source != "command line":
        return f"{name} = {value!r} in {source}", f"remove {name} from {source}"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        flag = flag if value else "--no-" + flag[2:]
        return flag, f"drop {flag}"
    return f"{flag} {value}", f"drop {flag}"


def _why(name: str) -> str:
    if name in MODEL_FIELDS:
        return "its weights have that model's names and shapes"
    if name in OPTIMIZER_FIELDS:
        return "its optimizer state carries the saved value"
    return "its saved data position counts batches of that size in that order"


def resume_config(
    file_values: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    config_file: str | None = None,
) -> TrainConfig:
    """The settings of ``--resume``: saved config, then ``file_values``, then ``overrides``
    (``None`` = not given), refusing a given value that contradicts a ``FIXED`` one."""
    kinds = field_types()
    given: dict[str, tuple[Any, str]] = {}
    for source, values in (
        (config_file or "the config file", file_values or {}),
        ("command line", overrides or {}),
    ):
        unknown = sorted(set(values) - set(kinds))
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {source}.")
        for name, value in values.items():
            if value is not None:
                given[name] = (coerce(name, value, kinds[name]), source)
    if "resume" not in given:
        raise ConfigError("resume_config needs a resume path.")
    checkpoint = find_checkpoint(given["resume"][0])
    saved = saved_config(checkpoint) or {}
    inherited = {
        name: coerce(name, value, kinds[name])
        for name, value in saved.items()
        if name in kinds and name not in NOT_INHERITED
    }
    if "steps" in given or "epochs" in given:  # one length: the given one replaces the saved
        inherited.pop("steps", None)
        inherited.pop("epochs", None)
    if "strategy" in given and given["strategy"][0] != inherited.get("strategy"):
        for name in declared_options():  # the saved strategy's options are not the new one's
            inherited.pop(name, None)
    for name in FIXED:
        if name in given and name in inherited and given[name][0] != inherited[name]:
            said, undo = _flag(name, *given[name])
            raise ConfigError(
                f"{said} contradicts checkpoint {checkpoint}, saved with {name} "
                f"{inherited[name]!r} ({_why(name)}); {undo} to resume it"
                + (
                    f", or start a fresh optimizer from the weights with `paratrain ckpt "
                    f"import {checkpoint} NEW_DIR` and --resume NEW_DIR."
                    if name not in MODEL_FIELDS
                    else "."
                )
            )
    merged = {**inherited, **{name: value for name, (value, _) in given.items()}}
    config = TrainConfig(**merged)
    flags = {name: value for name, (value, source) in given.items() if source == "command line"}
    refuse_foreign_flags(config.strategy, flags)
    return config
