"""``paratrain ckpt export RUN --format hf OUT``: a Hugging Face model folder.

What ``from_pretrained(OUT)`` reads, written as ``save_pretrained`` writes it:

- the weights as ``model.safetensors``; above ``--max-shard-size`` as
  ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json`` (its
  ``weight_map`` names each tensor's file), cut greedily in name order as Hugging Face
  cuts them (a tensor larger than the limit gets a file of its own);
- tied weights once, under the name ``named_parameters()`` gives first (the input
  embedding), which is the one Hugging Face keeps: its models re-tie the output head on
  loading, so the other name missing is expected and draws no warning;
- ``config.json``: the model's own ``config``, which paratrain saves with every checkpoint
  of a model that has one (``parallel/model_config.py``). A model without one (paratrain's
  own models) gets the weights only, and the command says so.

Every file carries safetensors' ``{"format": "pt"}`` header, which transformers checks.
The folder is assembled under a temporary name and renamed into place, so an interrupted
export leaves no half-written folder at ``OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from paratrain.checkpoints.file_modes import match_umask
from paratrain.checkpoints.format import Checkpoint
from paratrain.config import ConfigError
from paratrain.parallel.model_config import METADATA_KEY
from paratrain.runtime.units import format_bytes, parse_size

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Hugging Face's limit before transformers 5 (which raised it to 50GB); readable by all."""

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most ``max_shard_bytes`` each, in the given order; a
    tensor larger than the limit alone in its file (as Hugging Face splits)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def export_hf(checkpoint: Checkpoint, out: Path, max_shard_size: str | int) -> str:
    """Write ``checkpoint``'s model as a Hugging Face folder at ``out``; the line to print."""
    try:
        limit = parse_size(max_shard_size, name="--max-shard-size")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out} already exists and is not an empty folder; name a new folder or remove it."
        )
    state = {
        name: tensor.contiguous()
        for name, tensor in checkpoint.tensors("model")
        if name not in checkpoint.aliases  # a tied name is stored once, as HF stores it
    }
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    shards = shard_plan(sizes, limit)
    staging = out.parent / f".{out.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    files = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for file, names in zip(files, shards, strict=True):
        _write(staging / file, {name: state[name] for name in names})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {
                name: file for file, names in zip(files, shards, strict=True) for name in names
            },
        }
        _write_json(staging / INDEX, index)
    config = checkpoint.metadata.get(METADATA_KEY)
    if config is not None:
        _write_json(staging / CONFIG, config)
    if out.exists():
        out.rmdir()  # empty, checked above
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out)
    tied = f", {len(checkpoint.aliases)} tied name(s) stored once" if checkpoint.aliases else ""
    said = (
        f"wrote {out}: {len(state)} tensors, {format_bytes(sum(sizes.values()))} in "
        f"{len(files)} file(s){tied}, step {checkpoint.step}"
    )
    if config is None:
        said += (
            f"\nno {CONFIG} was written: the model saved no `config` (one with to_dict or "
            "to_json_string, as Hugging Face models have), so build the model yourself and "
            f"load {out} into it (safetensors.torch.load_model or load_state_dict)"
        )
    return said


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    match_umask(path)  # save_file creates 0600 files whatever the umask


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
