"""Run configuration: one typed dataclass, loadable from TOML, overridable per key.

Why a dataclass and not free-form dicts: a misspelt key in a config file must fail loudly
before any worker starts ("unknown key 'lrr'"), and the command line, the TOML file and
the Python API must all mean the same thing by each name.

``RunSettings`` holds what every run has; ``TrainConfig`` adds one field per option the
registered strategies declare (``paratrain.parallel.options.StrategyOption``), so a new
strategy's options become flags and TOML keys without an edit here.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from paratrain.data import DATASETS
from paratrain.models import MODEL_NAMES
from paratrain.parallel import (
    declared_options,
    default_strategy,
    strategy_class,
    strategy_names,
)
from paratrain.parallel.options import StrategyOption
from paratrain.parallel.precision import PRECISIONS
from paratrain.runtime.launch import BACKENDS
from paratrain.runtime.units import parse_size

SCHEDULES = ("constant", "cosine", "linear")
"""The learning-rate schedules (``--lr-schedule``); ``run/lr_schedule.py`` computes them."""

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


AUTO = "auto"
"""``--strategy auto``: the planner chooses the strategy and its options (``auto_plan``)."""


def declared_option_names() -> list[str]:
    """Every strategy option's field name."""
    return list(declared_options())


@dataclass
class RunSettings:
    """What every run has, whatever its strategy; each field is a ``--flag`` and a TOML key."""

    model: str = field(
        default="gpt",
        metadata={
            "help": "model to train: gpt takes a token dataset, mlp and lenet a "
            "classification one (lenet images only)",
            "choices": MODEL_NAMES,
        },
    )
    dataset: str = field(
        default="shakespeare",
        metadata={
            "help": "data to train on; shakespeare and fashion_mnist are read from "
            "--data-dir, $PARATRAIN_DATA or the cache, else downloaded once",
            "choices": DATASETS,
        },
    )
    strategy: str = field(
        default=default_strategy(),
        metadata={
            "help": "how the workers share the model; auto: the planner chooses the fastest "
            "layout predicted to fit --memory-per-device (strategy options given are kept)",
            "choices": (*strategy_names(), AUTO),
        },
    )
    devices: int | None = field(
        default=None,
        metadata={"help": "workers to start (default: the GPUs, else min(4, CPU cores))"},
    )
    steps: int | None = field(
        default=None, metadata={"help": "optimizer steps (300 unless --epochs is given)"}
    )
    epochs: int | None = field(
        default=None, metadata={"help": "passes over the training split, instead of --steps"}
    )
    global_batch: int = field(default=32, metadata={"help": "samples per optimizer step"})
    gradient_accumulation: int = field(default=1, metadata={"help": "micro-steps per step"})
    optimizer: str = field(
        default="adamw", metadata={"help": "optimizer", "choices": ("sgd", "adam", "adamw")}
    )
    lr: float = field(default=3e-3, metadata={"help": "learning rate"})
    lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "after warmup: constant, or cosine or linear decay to 0 at --steps",
            "choices": tuple(SCHEDULES),
        },
    )
    max_grad_norm: float | None = field(
        default=None,
        metadata={
            "help": "clip gradients to this global 2-norm, as clip_grad_norm_ on one device "
            "(default: no clipping)"
        },
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "steps of linear warmup from lr / warmup-steps to lr"}
    )
    momentum: float = field(default=0.0, metadata={"help": "SGD momentum, as in torch.optim.SGD"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    seed: int = field(default=0, metadata={"help": "seed for weights and data order"})
    block_size: int = field(default=64, metadata={"help": "context length (gpt)"})
    n_layer: int = field(default=4, metadata={"help": "transformer blocks (gpt)"})
    n_head: int = field(default=4, metadata={"help": "attention heads (gpt)"})
    n_embd: int = field(default=128, metadata={"help": "embedding width (gpt)"})
    tie_embeddings: bool = field(
        default=False, metadata={"help": "the head shares the token embedding's weight (gpt)"}
    )
    hidden: int = field(default=256, metadata={"help": "hidden width (mlp)"})
    depth: int = field(default=3, metadata={"help": "hidden layers (mlp)"})
    precision: str = field(
        default="fp32",
        metadata={"help": "autocast dtype; fp16 also scales the loss", "choices": PRECISIONS},
    )
    memory_per_device: str | None = field(
        default=None,
        metadata={
            "help": "memory budget per worker, e.g. 2GiB (a CPU worker acts that size) "
            "(default: no budget)"
        },
    )
    eval_every: int | None = field(
        default=None,
        metadata={
            "help": "steps between evaluations (default: 100; with --epochs, each epoch's "
            "end; 0: none)"
        },
    )
    eval_batches: int | str | None = field(
        default=None,
        metadata={
            "help": "batches per evaluation: a sample of N batches, or `all` for the whole "
            "test split (default: all with --epochs, else 4)",
            "words": ("all",),
        },
    )
    log_every: int = field(default=10, metadata={"help": "steps between metrics lines"})
    data_dir: str | None = field(
        default=None,
        metadata={
            "help": "an existing folder holding tinyshakespeare/input.txt or fashion_mnist/"
            "*-ubyte.gz, searched before $PARATRAIN_DATA and the download cache "
            "(default: none)"
        },
    )
    run_dir: str | None = field(
        default=None, metadata={"help": "output folder (default: runs/<model>-<strategy>-<time>)"}
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "replace the run already in --run-dir (its files are removed first); "
            "without it such a folder is refused"
        },
    )
    backend: str = field(
        default="auto",
        metadata={
            "help": "collectives: nccl needs a GPU per worker; auto picks it where there is one",
            "choices": BACKENDS,
        },
    )
    timeout: float = field(default=300.0, metadata={"help": "seconds any collective may wait"})
    sample_chars: int = field(default=200, metadata={"help": "generated text at the end (gpt)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: bool = field(
        default=False,
        metadata={
            "help": "also write the train and eval metrics as TensorBoard event files to "
            "RUN/tensorboard (needs the tensorboard package)"
        },
    )
    checkpoint_every: int = field(
        default=0, metadata={"help": "steps between checkpoints (0: only the final one)"}
    )
    keep_checkpoints: int = field(default=3, metadata={"help": "periodic checkpoints kept"})
    resume: str | None = field(
        default=None,
        metadata={"help": "run folder or checkpoint to continue from (default: a fresh run)"},
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "help": "restarts from the last checkpoint after a worker fails (with --elastic: "
            "replacement workers that join the running job)"
        },
    )
    elastic: bool = field(
        default=False,
        metadata={
            "help": "when a worker dies the others form a new group, redo the step in "
            "flight over themselves and go on, same final weights (a strategy where every "
            "worker holds the whole model)"
        },
    )
    min_devices: int = field(
        default=1, metadata={"help": "with --elastic: stop (last step saved) below this many"}
    )

    def __post_init__(self) -> None:
        for name, minimum in (
            ("steps", 1),
            ("global_batch", 1),
            ("gradient_accumulation", 1),
            ("block_size", 1),
            ("epochs", 1),
            ("log_every", 1),
            ("eval_every", 0),
            ("sample_chars", 0),
            ("checkpoint_every", 0),
            ("warmup_steps", 0),
            ("keep_checkpoints", 1),
            ("max_restarts", 0),
            ("min_devices", 1),
            ("n_layer", 1),
            ("n_head", 1),
            ("n_embd", 1),
            ("hidden", 1),
            ("depth", 0),
        ):
            value = getattr(self, name)
            if value is not None and value < minimum:
                raise ConfigError(f"{name} must be at least {minimum}, not {value}.")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("steps and epochs both set the run's length; pass only one of them.")
        if self.eval_batches != "all" and self.eval_batches is not None and self.eval_batches < 1:
            raise ConfigError(f"eval_batches must be at least 1 or all, not {self.eval_batches}.")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"devices must be at least 1, not {self.devices}.")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, not {self.lr}.")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be at least 0, not {self.weight_decay}.")
        if self.momentum < 0:
            raise ConfigError(f"momentum must be at least 0, not {self.momentum}.")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError(
                f"momentum is an SGD setting that {self.optimizer} has no use for; pass "
                "--optimizer sgd or leave --momentum out."
            )
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {self.timeout}.")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be positive, not {self.max_grad_norm}.")
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(
                f"lr_schedule must be one of {', '.join(SCHEDULES)}, not {self.lr_schedule!r}."
            )
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"optimizer must be sgd, adam or adamw, not {self.optimizer!r}.")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}."
            )
        try:
            parse_size(self.memory_per_device)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._check_strategy_options()

    def _check_strategy_options(self) -> None:
        """Each strategy option's value, and no option of another strategy left set (a
        flag given at its default is caught by ``refuse_foreign_flags``, which knows what
        the user passed)."""
        for name, (option, users) in declared_options().items():
            value = getattr(self, name)
            try:
                option.check(value)
            except ValueError as error:
                raise ConfigError(str(error)) from None
            if value != option.default and self.strategy not in (*users, AUTO):
                raise ConfigError(_foreign_option(name, value))

    def strategy_options(self) -> dict[str, Any]:
        """The chosen strategy's own options, as its engine takes them (``"2,3,3"`` for
        pipeline ``balance`` becomes ``[2, 3, 3]``); none for an unknown strategy."""
        if self.strategy not in strategy_names():
            return {}
        return {
            option.name: option.engine_value(getattr(self, option.name))
            for option in strategy_class(self.strategy).options
        }


def _foreign_option(name: str, value: Any) -> str:
    """The refusal of a strategy option set for a strategy that does not take it."""
    option, users = declared_options()[name]
    flag = option.flag if value is not False else "--no-" + option.flag[2:]
    owners = " or ".join(users) if len(users) < 3 else ", ".join(users)
    return f"{flag} is a {owners} option; pass --strategy {users[0]} or drop {flag}."


def refuse_foreign_flags(strategy: str, flags: dict[str, Any]) -> None:
    """Refuse a strategy option given on the command line (``flags``: name -> value) that
    ``strategy`` does not take, even at its default: ``--stages 2 --strategy dp`` asks for
    two stages, and dp would silently train without them. A switch turned off
    (``--no-recompute``) asks for nothing and passes. (``TrainConfig`` itself refuses only
    values off the default, as it cannot tell a given default from an untouched one; a
    TOML file's key at its default passes too, since a file may hold every key.)"""
    if strategy == AUTO:  # every option given is a constraint the planner keeps
        return
    options = declared_options()
    for name, value in flags.items():
        if name in options and value is not False and strategy not in options[name][1]:
            raise ConfigError(_foreign_option(name, value))


def _option_field(option: StrategyOption, users: list[str]) -> tuple[str, Any, Any]:
    """A dataclass field for a strategy option; its help names the strategies taking it
    (the command line lists its choices, if any, from ``choices``)."""
    metadata = {
        "help": f"{option.help} ({', '.join(users)})",
        "choices": tuple(option.choices) if option.choices else None,
        "none_allowed": option.none_allowed,
        "strategies": tuple(users),
    }
    kind = option.kind if option.default is not None else option.kind | None
    return option.name, kind, field(default=option.default, metadata=metadata)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [_option_field(option, users) for option, users in declared_options().values()],
    bases=(RunSettings,),
    namespace={
        "__doc__": "Everything ``paratrain train`` needs: the settings of every run, then "
        "each registered strategy's options. Every field is a ``--flag`` and a TOML key."
    },
)
TrainConfig.__module__ = __name__  # pickled by name into spawned workers


def field_types(cls: type | None = None) -> dict[str, type]:
    """Each field's base type (``int | None`` -> ``int``), for parsing and validation."""
    cls = cls or TrainConfig
    hints = typing.get_type_hints(cls)
    result = {}
    for item in fields(cls):
        hint = hints[item.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        result[item.name] = args[0] if is_union else hint
    return result


def _none_allowed(name: str) -> bool:
    """Whether a field takes the word "none" as a value (``staleness``: asynchronous)."""
    return any(f.name == name and f.metadata.get("none_allowed") for f in fields(TrainConfig))


def _words(name: str) -> tuple[str, ...]:
    """Words a number field takes besides numbers (``eval_batches``: all)."""
    return next((f.metadata.get("words", ()) for f in fields(TrainConfig) if f.name == name), ())


def coerce(name: str, value: Any, kind: type) -> Any:
    """Check (TOML) or convert (command line strings) one value to its field's type."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "none" and _none_allowed(name):
        return None  # TOML has no null and a flag has no None: "none" says it
    if isinstance(value, str) and value.strip().lower() in _words(name):
        return value.strip().lower()  # a word a number field also takes ("all")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind is str and isinstance(value, str):
        return value
    if isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    alternatives = "".join(f" or {word}" for word in _words(name))
    noun = _KIND_NOUNS.get(kind, f"a {kind.__name__}")
    raise ConfigError(f"{name} must be {noun}{alternatives}, not {value!r}.")


_KIND_NOUNS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
"""How a refusal names a field's type: words, not Python's type names."""


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML run file, refusing keys that are not TrainConfig fields."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check the --config path.") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}.") from None
    _refuse_unknown(data, source=str(path))
    return data


def _refuse_unknown(data: dict[str, Any], *, source: str) -> None:
    known = field_types()
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in {source}; known keys: {', '.join(known)}."
        )


def build_config(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then the TOML file's values, then command-line overrides (``None`` = unset)."""
    kinds = field_types()
    merged: dict[str, Any] = {}
    for source, values in (("config file", file_values or {}), ("overrides", overrides or {})):
        _refuse_unknown(values, source=source)
        for name, value in values.items():
            if value is not None:
                merged[name] = coerce(name, value, kinds[name])
    config = TrainConfig(**merged)
    given = {name: merged[name] for name, value in (overrides or {}).items() if value is not None}
    refuse_foreign_flags(config.strategy, given)
    return config


def as_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain dict of the config, for the metrics file and checkpoint manifest."""
    return dataclasses.asdict(config)
