"""``paratrain ckpt import SOURCE OUT_DIR --model ...``: weights from elsewhere made a
paratrain checkpoint that ``paratrain train --resume OUT_DIR`` continues under any
strategy.

The source is anything ``paratrain.load_model_state`` reads (a ``.pt``/``.pth``/``.bin``
state dict, perhaps from ``nn.DataParallel`` or DDP with ``module.`` names, a
``.safetensors`` file, a paratrain checkpoint or run folder, a PyTorch distributed
checkpoint folder). It is checked, name by name
and shape by shape, against the reference model the flags describe (built on the meta
device: no weights are made), stored in that model's dtypes with tied names stored once,
and saved with the model's settings as its config: the resume takes the model from it and
everything else (optimizer, data, steps) from its own flags. Only a DCP folder brings
optimizer state (``dcp_format``), which the resume continues; otherwise the optimizer
starts fresh, and the command says which.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from paratrain.checkpoint import CheckpointError, save_model_state
from paratrain.config import ConfigError, build_config
from paratrain.dcp_format import optimizer_settings, read_dcp_optimizer
from paratrain.dcp_read import is_dcp_folder
from paratrain.model_state import load_model_state, strip_wrappers
from paratrain.parallel.ties import tied_names
from paratrain.resume_config import MODEL_FIELDS, saved_config
from paratrain.run_checkpoints import find_checkpoint

IMPORT_FIELDS = (*MODEL_FIELDS, "data_dir")
"""The flags ``ckpt import`` takes: the model, and the dataset that sizes it."""


def import_command(args: argparse.Namespace) -> int:
    from paratrain.models import MODEL_NAMES, build_model
    from paratrain.trainer import check_pairing, load_data, model_options

    source = Path(args.source)
    given = {name: getattr(args, name) for name in IMPORT_FIELDS}
    saved = _saved_model_settings(source)  # a paratrain checkpoint knows its model
    config = build_config(saved, {k: v for k, v in given.items() if v is not None})
    if config.model not in MODEL_NAMES:
        raise ConfigError(
            f"unknown model {config.model!r}; choose one of {', '.join(MODEL_NAMES)}."
        )
    bundle = load_data(config)
    check_pairing(config, bundle)
    with torch.device("meta"):
        model = build_model(config.model, **model_options(config, bundle))
    stored = load_model_state(source)
    state = load_model_state(source, model=model)  # wrappers stripped, names/shapes checked
    expected = model.state_dict()
    state = {name: tensor.to(expected[name].dtype) for name, tensor in state.items()}
    for alias, canonical in tied_names(model).items():
        if not torch.equal(state[alias], state[canonical]):
            raise CheckpointError(
                f"{source} holds different values for {canonical!r} and {alias!r}, which "
                "this model ties: it was saved from a model without the tie; drop "
                "--tie-embeddings."
            )
        state[alias] = state[canonical]  # one tensor: stored once, the alias recorded
    out = Path(args.out)
    settings = {name: getattr(config, name) for name in MODEL_FIELDS}
    optimizer = read_dcp_optimizer(source, model) if is_dcp_folder(source) else None
    if optimizer is not None:  # --resume takes the optimizer that made the state
        settings.update(optimizer_settings(optimizer))
    save_model_state(
        out,
        state,
        metadata={"step": 0, "config": settings, "imported_from": str(source)},
        optimizer=optimizer,
    )
    renamed = sorted(set(stored) - set(state))
    note = f" ({renamed[0]!r} read as {strip_wrappers(renamed[0])!r}, ...)" if renamed else ""
    values = sum(t.numel() for name, t in state.items() if name not in tied_names(model))
    print(
        f"imported {source} into {out}: {config.model} on {config.dataset}, {len(state)} "
        f"tensors, {values:,} values{note}\n"
        + (
            "the file holds model weights only: the optimizer starts fresh"
            if optimizer is None
            else f"optimizer state carried ({_state_keys(optimizer)}"
            + (
                f", {settings['optimizer']} lr {settings['lr']}): the resume continues it"
                if "optimizer" in settings
                else "): resume it with the optimizer that made it"
            )
        )
        + f"; continue with paratrain train --resume {out} --steps N"
    )
    return 0


def _state_keys(optimizer: tuple[dict, list]) -> str:
    return ", ".join(sorted({key.rpartition("/")[2] for key in optimizer[0]})) or "no tensors"


def _saved_model_settings(source: Path) -> dict:
    """The model settings saved in a paratrain checkpoint or run folder; none elsewhere
    (flags given for it must then agree with the weights, which the import checks)."""
    if not source.is_dir():
        return {}
    try:
        saved = saved_config(find_checkpoint(source)) or {}
    except (ConfigError, CheckpointError):
        return {}  # load_model_state says what is wrong with it
    return {name: saved[name] for name in MODEL_FIELDS if name in saved}
