"""Every check of a run made in the parent, before any worker starts: one place.

In the order ``prepare.py`` asks them: the names and folders (``check_names``: model,
dataset, strategy, ``--data-dir``, ``--tensorboard``) before anything is created on disk,
so a mistyped name costs one sentence and leaves nothing behind; the devices and the
strategy's own checks without the data (``check_layout``), so a bad layout is refused
before any download; then, with the dataset, the model's pairing with it
(``check_pairing``) and the strategy's checks against the model on the meta device and
the memory budget (``check_model``). The time-sharing warning is printed by ``fit`` once
every check has passed, so that a refused run says only why.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from paratrain.config import ConfigError, TrainConfig
from paratrain.data import DATASETS, DatasetBundle, dataset_key
from paratrain.models import MODEL_NAMES
from paratrain.parallel import strategy_class, strategy_names
from paratrain.parallel.fit_advice import advice
from paratrain.reports.tensorboard_log import check_tensorboard
from paratrain.run.build import run_spec
from paratrain.run.elastic_checks import check_elastic
from paratrain.runtime.external_job import check_job_devices
from paratrain.runtime.launch import (
    BACKENDS,
    default_device_count,
    in_external_job,
    resolve_backend,
)
from paratrain.runtime.units import format_bytes, parse_size

_TOKEN_MODELS = ("gpt",)
_IMAGE_MODELS = ("lenet",)


def check_config(config: TrainConfig) -> int:
    """Everything that needs no data (``check_names``, then ``check_layout``); returns the
    device count."""
    check_names(config)
    return check_layout(config)


def check_names(config: TrainConfig, *, strategy: bool = True) -> None:
    """Refuse an unknown model, dataset or strategy, a ``--data-dir`` that is not a folder
    and ``--tensorboard`` without its package. ``strategy=False`` for a run the planner is
    still to choose for (``auto``, ``paratrain plan``): the planner judges that name."""
    if config.model not in MODEL_NAMES:
        raise ConfigError(unknown_name("model", config.model, MODEL_NAMES))
    check_dataset(config)
    if strategy and config.strategy not in strategy_names():
        raise ConfigError(unknown_name("strategy", config.strategy, strategy_names()))
    check_data_dir(config)
    check_tensorboard(config)


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> str:
    """The refusal of an unknown name: the closest known one first where it is a likely
    typo (``gtp`` -> gpt, ``zer03`` -> zero3: one edit per four letters, a swap of two
    neighbours counting one), then every choice. difflib ranks the candidates; the edit
    count keeps it from offering lenet for resnet, which is another model, not a typo."""
    choices = list(choices)
    allowed = max(1, len(name) // 4)
    close = [
        choice
        for choice in difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.5)
        if _edits(name.lower(), choice) <= allowed
    ]
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {kind} {name!r}; {guess}choose one of {', '.join(choices)}."


def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that make ``a`` into
    ``b`` (the optimal string alignment distance)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def check_layout(config: TrainConfig) -> int:
    """The backend, the job's devices and the strategy's checks of the run without the
    model (``Engine.check_run``: degrees, batch splits); returns the device count."""
    devices = config.devices or default_device_count()
    check_backend(config, devices)
    check_elastic(config, devices)
    _ask_strategy(config, devices)
    return devices


def check_model(config: TrainConfig, devices: int, bundle: DatasetBundle, model: nn.Module) -> None:
    """The model's own options (built on the meta device), the strategy's checks against
    it, then the memory budget against its parameters."""
    check_model_options(model)
    _ask_strategy(config, devices, bundle, model)
    check_memory(config, devices, model)


def check_model_options(model: Callable[[], nn.Module]) -> None:
    """Build the model on the meta device, so that an option its builder refuses (``--n-embd
    66`` with 4 heads) is one sentence here rather than a traceback in every worker."""
    try:
        model()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _ask_strategy(
    config: TrainConfig,
    devices: int,
    bundle: DatasetBundle | None = None,
    model: Callable[[], nn.Module] | None = None,
) -> None:
    """``Engine.check_run``, its ``ValueError`` made the run's one-sentence refusal."""
    try:
        if in_external_job():
            check_job_devices(config.devices)
        strategy_class(config.strategy).check_run(run_spec(config, devices, bundle, model))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def refuse_planning_in_job() -> None:
    """``--strategy auto`` inside torchrun: the plan must be made before the workers."""
    if in_external_job():
        raise ConfigError(
            "--strategy auto plans before the workers start, which torchrun does not let it "
            "do; run `paratrain plan` with the same flags and pass the strategy it prints."
        )


def check_pairing(config: TrainConfig, bundle: DatasetBundle) -> None:
    """A token model needs a token dataset, an image model an image dataset."""
    wants_tokens = config.model in _TOKEN_MODELS
    if wants_tokens != (bundle.kind == "tokens"):
        need = (
            "a token dataset (shakespeare, synthetic_tokens)"
            if wants_tokens
            else ("a classification dataset (fashion_mnist, synthetic, synthetic_images)")
        )
        raise ConfigError(f"model {config.model!r} needs {need}, not {config.dataset!r}.")
    if config.model in _IMAGE_MODELS and len(bundle.input_shape) != 3:
        raise ConfigError(
            f"model {config.model!r} needs image-shaped inputs (C, H, W), but {config.dataset!r} "
            f"gives {tuple(bundle.input_shape)}; use fashion_mnist or synthetic_images."
        )
    if len(bundle.train) < config.global_batch:
        raise ConfigError(
            f"dataset {config.dataset!r} has {len(bundle.train)} training samples, fewer than "
            f"one global batch of {config.global_batch}; lower --global-batch."
        )


def check_memory(config: TrainConfig, devices: int, model: Callable[[], nn.Module]) -> None:
    """Refuse a budget that the parameters alone exceed, counted on the meta-device model.

    Only what is certain before training is checked (parameters, at the share the strategy
    gives each worker at best); gradients, optimizer state and activations are checked by
    each worker's ledger from the first step on.
    """
    budget = parse_size(config.memory_per_device)
    if budget is None:
        return
    parameters = list(dict.fromkeys(model().parameters()))
    share = strategy_class(config.strategy).parameter_share(devices, config.strategy_options())
    if share is None:
        return
    held = sum(p.numel() * p.element_size() for p in parameters) * share
    if held > budget:
        raise ConfigError(
            f"the parameters alone need {format_bytes(held)} per worker under strategy "
            f"{config.strategy!r}, over --memory-per-device {format_bytes(budget)}; "
            + advice(
                parameters=sum(p.numel() for p in parameters),
                workers=devices,
                budget=budget,
                candidates=strategy_names(),
                current=config.strategy,
            )
            + "."
        )


def check_dataset(config: TrainConfig) -> None:
    """Refuse a dataset name the registry does not know."""
    try:
        dataset_key(config.dataset)
    except ValueError:
        raise ConfigError(unknown_name("dataset", config.dataset, DATASETS)) from None


def check_data_dir(config: TrainConfig) -> None:
    """Refuse a ``--data-dir`` that is not a folder: a mistyped path would otherwise be
    passed over in silence and the data fetched (or refused) from elsewhere."""
    if config.data_dir is None:
        return
    path = Path(config.data_dir).expanduser()
    if path.is_dir():
        return
    state = "is not a folder" if path.exists() else "does not exist"
    raise ConfigError(
        f"--data-dir {path} {state}; pass the folder that holds tinyshakespeare/input.txt "
        "or fashion_mnist/*-ubyte.gz, or leave --data-dir out to read $PARATRAIN_DATA "
        "and the download cache."
    )


def check_backend(config: TrainConfig, devices: int) -> None:
    """Refuse an unknown backend, and NCCL where this machine has too few GPUs for it
    (inside torchrun each process needs one GPU of its own)."""
    if config.backend not in BACKENDS:
        raise ConfigError(unknown_name("backend", config.backend, BACKENDS))
    if config.backend != "nccl":
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = 1 if in_external_job() else devices
    if gpus < needed:
        raise ConfigError(
            f"--backend nccl needs one GPU per worker, but {needed} worker(s) were asked "
            f"for and {gpus} GPU(s) are visible; pass --backend gloo (CPU workers) or "
            "--backend auto."
        )


def time_sharing_warning(config: TrainConfig, devices: int) -> str | None:
    """One line where more CPU workers were asked for than the machine has cores: the run
    is still correct, but the workers take turns on the cores, so its timings are not
    those of that many devices."""
    cores = os.cpu_count() or 1
    if in_external_job() or devices <= cores:
        return None
    if resolve_backend(config.backend, devices) != "gloo":
        return None
    return (
        f"paratrain: warning: --devices {devices} starts {devices} CPU workers on {cores} "
        f"core(s); the workers will time-share the cores, so steps run slower than with "
        f"--devices {cores} (the results are the same)."
    )
