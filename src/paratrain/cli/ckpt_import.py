"""``paratrain ckpt import SOURCE OUT_DIR --model ...``: weights from elsewhere made a
paratrain checkpoint that ``paratrain train --resume OUT_DIR`` continues under any
strategy.

The flags describe the reference model (built on the meta device) the weights are checked
against (``checkpoints/importing.py``); the checkpoint is saved with the model's settings
as its config, so the resume takes the model from it and everything else (optimizer,
data, steps) from its own flags. Only a DCP folder brings optimizer state
(``checkpoints/dcp_format.py``), which the resume continues; otherwise the optimizer starts
fresh, and the command says which.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratrain.checkpoints.dcp_format import optimizer_settings, read_dcp_optimizer
from paratrain.checkpoints.dcp_read import is_dcp_folder
from paratrain.checkpoints.format import CheckpointError
from paratrain.checkpoints.importing import import_weights
from paratrain.checkpoints.locate import find_checkpoint
from paratrain.config import ConfigError, build_config
from paratrain.run.resume_config import MODEL_FIELDS, saved_config

IMPORT_FIELDS = (*MODEL_FIELDS, "data_dir")
"""The flags ``ckpt import`` takes: the model, and the dataset that sizes it."""


def import_command(args: argparse.Namespace) -> int:
    from paratrain.models import MODEL_NAMES
    from paratrain.run.build import load_data, meta_model
    from paratrain.run.preflight import check_pairing

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
    out = Path(args.out)
    model = meta_model(config, bundle)
    settings = {name: getattr(config, name) for name in MODEL_FIELDS}
    optimizer = read_dcp_optimizer(source, model) if is_dcp_folder(source) else None
    if optimizer is not None:  # --resume takes the optimizer that made the state
        settings.update(optimizer_settings(optimizer))
    metadata = {"step": 0, "config": settings, "imported_from": str(source)}
    imported = import_weights(source, model, out, metadata, optimizer=optimizer)
    print(
        f"imported {source} into {out}: {config.model} on {config.dataset}, "
        f"{imported.tensors} tensors, {imported.values:,} values{imported.renamed_note()}\n"
        + _optimizer_note(optimizer, settings)
        + f"; continue with paratrain train --resume {out} --steps N"
    )
    return 0


def _optimizer_note(optimizer: tuple[dict, list] | None, settings: dict) -> str:
    """What the resume will do with the optimizer: start fresh, or continue the state."""
    if optimizer is None:
        return "the file holds model weights only: the optimizer starts fresh"
    keys = ", ".join(sorted({key.rpartition("/")[2] for key in optimizer[0]})) or "no tensors"
    if "optimizer" in settings:
        return (
            f"optimizer state carried ({keys}, {settings['optimizer']} lr {settings['lr']}): "
            "the resume continues it"
        )
    return f"optimizer state carried ({keys}): resume it with the optimizer that made it"


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
