"""What a run's config makes: its dataset, the model's options, the optimizer factory, the
strategy's view of the run (``RunSpec``) and the engine's keywords.

The parent (``prepare.py``) and every worker (``worker.py``) build from the config through
these same functions, so the model the parent checks on the meta device is the model the
workers train.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.config import ConfigError, TrainConfig
from paratrain.data import ChecksumError, DatasetBundle, DatasetUnavailable, build_dataset
from paratrain.models import build_model
from paratrain.parallel import RunSpec, strategy_class
from paratrain.runtime import comm
from paratrain.runtime.launch import in_external_job


def load_data(config: TrainConfig) -> DatasetBundle:
    """The run's dataset (downloaded and cached on first use); a dataset neither on disk
    nor downloadable, or a download or cached copy that fails its checksum, is refused with
    the data layer's sentence, which says what to do."""
    try:
        return build_dataset(
            config.dataset, data_dir=config.data_dir, block_size=config.block_size, seed=config.seed
        )
    except (DatasetUnavailable, ChecksumError) as error:
        raise ConfigError(str(error)) from None


def model_options(config: TrainConfig, bundle: DatasetBundle) -> dict[str, Any]:
    """The model's constructor options, sized from the config and the dataset."""
    if config.model == "gpt":
        return {
            "vocab_size": bundle.vocab_size,
            "block_size": config.block_size,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_embd": config.n_embd,
            "tie_embeddings": config.tie_embeddings,
        }
    classes = bundle.num_classes
    if config.model == "mlp":
        return {
            "in_features": math.prod(bundle.input_shape),
            "hidden": config.hidden,
            "depth": config.depth,
            "classes": classes,
        }
    return {"classes": classes, "in_channels": bundle.input_shape[0]}


def meta_model(config: TrainConfig, bundle: DatasetBundle) -> nn.Module:
    """The run's model on the meta device: names, shapes and layers, no weights."""
    with torch.device("meta"):
        return build_model(config.model, **model_options(config, bundle))


def meta_model_once(config: TrainConfig, bundle: DatasetBundle) -> Callable[[], nn.Module]:
    """``meta_model`` built on first call and the same model returned after: the parent's
    checks share one (``preflight.check_model_options`` builds it first, so that an option
    the builder refuses is refused before launch)."""
    built: list[nn.Module] = []

    def build() -> nn.Module:
        if not built:
            built.append(meta_model(config, bundle))
        return built[0]

    return build


def make_optimizer(config: TrainConfig):
    """The optimizer factory the engine calls with the parameters it owns."""
    name, lr, decay = config.optimizer, config.lr, config.weight_decay
    if name == "sgd":
        return lambda params: torch.optim.SGD(
            params, lr=lr, momentum=config.momentum, weight_decay=decay
        )
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=decay)
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=decay)


def run_spec(
    config: TrainConfig,
    devices: int,
    bundle: DatasetBundle | None = None,
    model: Callable[[], nn.Module] | None = None,
) -> RunSpec:
    """The run as the strategy sees it before any worker starts.

    With the dataset's ``bundle`` the strategy may look at the model on the meta device:
    through ``model`` where the caller shares one (``meta_model_once``), else built anew
    each time the strategy asks.
    """

    def build_meta_model() -> nn.Module:
        return model() if model is not None else meta_model(config, bundle)

    return RunSpec(
        devices=devices,
        global_batch=config.global_batch,
        gradient_accumulation=config.gradient_accumulation,
        options=config.strategy_options(),
        external_job=in_external_job(),
        timeout_s=config.timeout,
        max_grad_norm=config.max_grad_norm,
        build_model=build_meta_model if bundle is not None else None,
        sample_inputs=(lambda n: bundle.train[:n][0]) if bundle is not None else None,
    )


def strategy_options(config: TrainConfig, bundle: DatasetBundle | None) -> dict[str, Any]:
    """The engine's keywords from the config: the strategy's own options, what the run adds
    to them (``Engine.launch_options``), and the shared ones.

    The shared options every engine takes (precision, memory_per_device) are passed only
    when they differ from the engines' defaults, which keeps a user's custom engine that
    predates them working.
    """
    options = config.strategy_options()
    devices = comm.world_size() if comm.distributed() else (config.devices or 1)
    options.update(
        strategy_class(config.strategy).launch_options(run_spec(config, devices, bundle))
    )
    if config.precision != "fp32":
        options["precision"] = config.precision
    if config.memory_per_device is not None:
        options["memory_per_device"] = config.memory_per_device
    if config.max_grad_norm is not None:
        options["max_grad_norm"] = config.max_grad_norm
    return options
