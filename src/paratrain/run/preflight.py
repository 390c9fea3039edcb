"""Checks of a run's dataset name, data folder, backend and worker count that need neither
the data nor a worker.

``trainer.validate`` runs them in the parent before anything is created on disk (the run
folder, a cache folder), so a mistyped name, a missing folder or a backend the machine
cannot give costs one sentence and leaves nothing behind, as an unknown ``--model`` does.
The time-sharing warning is printed by ``fit`` once every check has passed, so that a
refused run says only why.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paratrain.config import ConfigError, TrainConfig
from paratrain.data import DATASETS, dataset_key
from paratrain.runtime.launch import BACKENDS, in_external_job, resolve_backend


def check_dataset(config: TrainConfig) -> None:
    """Refuse a dataset name the registry does not know."""
    try:
        dataset_key(config.dataset)
    except ValueError:
        raise ConfigError(
            f"unknown dataset {config.dataset!r}; choose one of {', '.join(DATASETS)}."
        ) from None


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
        raise ConfigError(
            f"unknown backend {config.backend!r}; choose one of {', '.join(BACKENDS)}."
        )
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
