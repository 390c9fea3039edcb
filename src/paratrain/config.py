"""Run configuration: one typed dataclass, loadable from TOML, overridable per key.

Why a dataclass and not free-form dicts: a misspelt key in a config file must fail loudly
before any worker starts ("unknown key 'lrr'"), and the command line, the TOML file and
the Python API must all mean the same thing by each name.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from paratrain.parallel.parameter_server.shared_memory import TRANSPORTS as PS_TRANSPORTS
from paratrain.parallel.parameter_server.stale_lr import POLICIES as STALENESS_LR_POLICIES
from paratrain.parallel.precision import PRECISIONS
from paratrain.runtime.units import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


@dataclass
class TrainConfig:
    """Everything ``paratrain train`` needs; each field is also a ``--flag`` and a TOML key."""

    model: str = field(default="gpt", metadata={"help": "mlp, lenet or gpt"})
    dataset: str = field(
        default="shakespeare",
        metadata={"help": "shakespeare, fashion_mnist, synthetic, synthetic_images, ..."},
    )
    strategy: str = field(
        default="dp", metadata={"help": "single, dp, zero1, zero2, zero3, pipeline or ps"}
    )
    devices: int | None = field(
        default=None, metadata={"help": "workers to start (default: GPUs, else min(4, cores))"}
    )
    steps: int = field(default=300, metadata={"help": "optimizer steps"})
    global_batch: int = field(default=32, metadata={"help": "samples per optimizer step"})
    gradient_accumulation: int = field(default=1, metadata={"help": "micro-steps per step"})
    optimizer: str = field(default="adamw", metadata={"help": "sgd, adam or adamw"})
    lr: float = field(default=3e-3, metadata={"help": "learning rate"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    seed: int = field(default=0, metadata={"help": "seed for weights and data order"})
    block_size: int = field(default=64, metadata={"help": "context length (gpt)"})
    n_layer: int = field(default=4, metadata={"help": "transformer blocks (gpt)"})
    n_head: int = field(default=4, metadata={"help": "attention heads (gpt)"})
    n_embd: int = field(default=128, metadata={"help": "embedding width (gpt)"})
    hidden: int = field(default=256, metadata={"help": "hidden width (mlp)"})
    depth: int = field(default=3, metadata={"help": "hidden layers (mlp)"})
    bucket_mb: float = field(
        default=25.0, metadata={"help": "all-reduce bucket size (dp, zero1, zero2)"}
    )
    stages: int = field(default=2, metadata={"help": "pipeline stages (pipeline)"})
    micro_batches: int | None = field(
        default=None, metadata={"help": "micro-batches per step (pipeline; default 2 x stages)"}
    )
    schedule: str = field(default="1f1b", metadata={"help": "1f1b or gpipe (pipeline)"})
    balance: str | None = field(
        default=None, metadata={"help": "layers per stage, e.g. 2,3,3 (pipeline)"}
    )
    balance_by: str = field(
        default="params", metadata={"help": "params, time or memory (pipeline)"}
    )
    recompute: bool = field(
        default=False,
        metadata={"help": "recompute activations in backward (single, dp, pipeline, zero1-3)"},
    )
    precision: str = field(
        default="fp32", metadata={"help": "fp32, bf16 or fp16 (autocast; fp16 scales the loss)"}
    )
    memory_per_device: str | None = field(
        default=None,
        metadata={"help": "memory budget per worker, e.g. 2GiB (a CPU worker acts that size)"},
    )
    servers: int = field(default=1, metadata={"help": "parameter-server processes (ps)"})
    staleness: int | None = field(
        default=0,
        metadata={
            "help": "steps a worker may run ahead of the slowest (ps; 0 = synchronous, "
            "none = asynchronous)",
            "none_allowed": True,
        },
    )
    staleness_lr: str = field(
        default="inverse",
        metadata={
            "help": "ps: inverse divides a push's learning rate by its staleness + 1, "
            "constant applies every push at --lr"
        },
    )
    backup_workers: int = field(
        default=0,
        metadata={
            "help": "ps with --staleness 0: a version needs only the first N - this many "
            "workers' pushes; later ones fold into the next (no waiting for stragglers)"
        },
    )
    lookahead: bool = field(
        default=True,
        metadata={
            "help": "ps, asynchronous or bounded: a step's pull returns the parameters "
            "extrapolated to where they will be when its push lands"
        },
    )
    transport: str = field(
        default="auto",
        metadata={
            "help": "ps: how pushes and pulls travel: auto (shared memory where the host has "
            "/dev/shm, else gloo), shared_memory or gloo"
        },
    )
    straggler: str | None = field(
        default=None,
        metadata={"help": "RANK:SLOWDOWN, e.g. 1:3 makes worker 1 three times slower (ps)"},
    )
    eval_every: int = field(default=100, metadata={"help": "steps between evaluations"})
    eval_batches: int = field(default=4, metadata={"help": "batches per evaluation"})
    log_every: int = field(default=10, metadata={"help": "steps between metrics lines"})
    data_dir: str | None = field(default=None, metadata={"help": "folder holding datasets"})
    run_dir: str | None = field(
        default=None, metadata={"help": "output folder (default runs/<model>-<strategy>-<time>)"}
    )
    backend: str = field(default="auto", metadata={"help": "auto, gloo or nccl"})
    timeout: float = field(default=300.0, metadata={"help": "seconds any collective may wait"})
    sample_chars: int = field(default=200, metadata={"help": "generated text at the end (gpt)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    checkpoint_every: int = field(
        default=0, metadata={"help": "steps between checkpoints (0: only the final one)"}
    )
    keep_checkpoints: int = field(default=3, metadata={"help": "periodic checkpoints kept"})
    resume: str | None = field(
        default=None, metadata={"help": "run folder or checkpoint to continue from"}
    )
    max_restarts: int = field(
        default=0, metadata={"help": "restarts from the last checkpoint after a worker fails"}
    )

    def __post_init__(self) -> None:
        for name, minimum in (
            ("steps", 1),
            ("global_batch", 1),
            ("gradient_accumulation", 1),
            ("block_size", 1),
            ("eval_batches", 1),
            ("log_every", 1),
            ("eval_every", 0),
            ("sample_chars", 0),
            ("stages", 1),
            ("checkpoint_every", 0),
            ("keep_checkpoints", 1),
            ("max_restarts", 0),
            ("servers", 1),
            ("backup_workers", 0),
        ):
            value = getattr(self, name)
            if value < minimum:
                raise ConfigError(f"{name} must be at least {minimum}, not {value}.")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"devices must be at least 1, not {self.devices}.")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, not {self.lr}.")
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {self.timeout}.")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, not {self.micro_batches}.")
        self.balance_list()
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(
                f"staleness must be at least 0 (or none for asynchronous), not {self.staleness}."
            )
        if self.staleness_lr not in STALENESS_LR_POLICIES:
            raise ConfigError(
                f"staleness_lr must be {' or '.join(STALENESS_LR_POLICIES)}, not "
                f"{self.staleness_lr!r}."
            )
        if self.transport not in PS_TRANSPORTS:
            raise ConfigError(
                f"transport must be one of {', '.join(PS_TRANSPORTS)}, not {self.transport!r}."
            )
        self.straggler_setting()
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

    def straggler_setting(self) -> dict[str, float | int] | None:
        """``straggler`` ("1:3") as the ps engine's ``{"rank": 1, "slowdown": 3.0}``."""
        if self.straggler is None:
            return None
        rank, _, slowdown = self.straggler.partition(":")
        try:
            setting = {"rank": int(rank), "slowdown": float(slowdown)}
        except ValueError:
            setting = None
        if setting is None or setting["rank"] < 0 or setting["slowdown"] < 1:
            raise ConfigError(
                f"straggler must be RANK:SLOWDOWN with a slowdown of at least 1, such as 1:3, "
                f"not {self.straggler!r}."
            )
        return setting

    def balance_list(self) -> list[int] | None:
        """``balance`` ("2,3,3") as a list of layer counts."""
        if self.balance is None:
            return None
        try:
            return [int(part) for part in self.balance.split(",")]
        except ValueError:
            raise ConfigError(
                f"balance must be comma-separated layer counts such as 2,3,3, not {self.balance!r}."
            ) from None


def field_types(cls: type = TrainConfig) -> dict[str, type]:
    """Each field's base type (``int | None`` -> ``int``), for parsing and validation."""
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


def coerce(name: str, value: Any, kind: type) -> Any:
    """Check (TOML) or convert (command line strings) one value to its field's type."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "none" and _none_allowed(name):
        return None  # TOML has no null and a flag has no None: "none" says it
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
    raise ConfigError(f"{name} must be a {kind.__name__}, not {value!r}.")


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
    return TrainConfig(**merged)


def as_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain dict of the config, for the metrics file and checkpoint manifest."""
    return dataclasses.asdict(config)
