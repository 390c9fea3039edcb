"""PyTorch distributed checkpoints (DCP) in and out of paratrain's canonical checkpoints.

In (``paratrain ckpt import DCP_DIR OUT --model ...``): the model state (``dcp_read``
finds it and reads it without running its pickles) goes through the same checks as any
imported weights (``load_model_state``: wrapper segments ``module.``, ``_orig_mod.``,
``_fsdp_wrapped_module.`` stripped, names and shapes checked); the optimizer state,
where the folder has one, becomes paratrain's named optimizer state, so that
``--resume`` continues it exactly (with the same ``--optimizer``). Optimizer state
keyed by parameter name (``get_state_dict``, ``get_optimizer_state_dict``) is mapped by
name; keyed by position (a plain ``optimizer.state_dict()``) it is mapped to the model's
parameters in ``model.parameters()`` order, the order an optimizer built from them numbers
them, and refused where the count or a shape disagrees.

Out (``paratrain ckpt export RUN --format dcp OUT``): ``{"model": state_dict, "optim":
{"state": {name: {key: tensor}}, "param_groups": [...]}}`` written with torch's own
``FileSystemWriter`` on one process, which is what ``get_state_dict`` gives and what
``dcp.load({"model": model.state_dict()}, checkpoint_id=OUT)`` reads into a plain model.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.dcp_read import read_dcp, sections
from paratrain.checkpoints.format import Checkpoint, CheckpointError
from paratrain.checkpoints.model_state import strip_wrappers
from paratrain.config import ConfigError
from paratrain.parallel.ties import tied_names

NamedOptimizerState = tuple[dict[str, torch.Tensor], list[dict[str, Any]]]
"""Tensors by ``"<parameter name>/<state key>"`` and the groups with parameter names."""


def read_dcp_optimizer(folder: str | Path, model: nn.Module) -> NamedOptimizerState | None:
    """The folder's optimizer state in ``model``'s canonical names; None where it has none."""
    folder = Path(folder)
    _, optim = sections(read_dcp(folder), folder)
    if optim is None:
        return None
    # an optimizer with no state yet (SGD without momentum) saves no 'state' at all
    state = optim.get("state", {}) if isinstance(optim, dict) else None
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list):
        raise CheckpointError(
            f"{folder} holds optimizer state in a layout paratrain does not read (it reads "
            "an optimizer's state_dict() or get_optimizer_state_dict(): 'state' and "
            "'param_groups'); save it unflattened."
        )
    parameters = dict(model.named_parameters())  # canonical names, tied ones once
    name_of = _parameter_names(folder, groups, list(parameters), tied_names(model))
    tensors: dict[str, torch.Tensor] = {}
    for key, entries in state.items():
        name = name_of.get(str(key))
        if name is None:
            raise CheckpointError(
                f"{folder} holds optimizer state for {key!r}, which no parameter group lists."
            )
        for state_key, value in entries.items():
            if value is None:  # SGD without momentum keeps momentum_buffer None
                continue
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            if tensor.dim() > 0 and tuple(tensor.shape) != tuple(parameters[name].shape):
                raise CheckpointError(
                    f"{folder} holds optimizer state {key!r}/{state_key} of shape "
                    f"{tuple(tensor.shape)} for {name!r} of shape "
                    f"{tuple(parameters[name].shape)}: it belongs to another model or order."
                )
            tensors[f"{name}/{state_key}"] = tensor
    named_groups = [
        {
            **{k: _json_value(v) for k, v in group.items() if k != "params"},
            "params": [name_of[str(p)] for p in group["params"]],
        }
        for group in groups
    ]
    return tensors, named_groups


def optimizer_settings(optimizer: NamedOptimizerState) -> dict[str, Any]:
    """The command line's optimizer settings that made this state (``optimizer``, ``lr``,
    ``weight_decay``, ``momentum``), saved with the imported checkpoint so that
    ``--resume`` takes them and refuses a contradicting flag; none where the state is of
    an optimizer the command line does not build (the API resumes it with that one) or
    its groups differ (no one flag value)."""
    tensors, groups = optimizer
    keys = {key.rpartition("/")[2] for key in tensors}
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    if not hyper or any(h != hyper[0] for h in hyper[1:]):
        return {}
    group = hyper[0]
    if keys <= {"momentum_buffer"} and "momentum" in group and "dampening" in group:
        kind = {"optimizer": "sgd", "momentum": group["momentum"]}
    elif keys == {"exp_avg", "exp_avg_sq", "step"} and not group.get("amsgrad"):
        if "decoupled_weight_decay" not in group:  # before torch 2.6 Adam and AdamW agree
            return {}
        kind = {"optimizer": "adamw" if group["decoupled_weight_decay"] else "adam"}
    else:
        return {}
    return {**kind, "lr": group["lr"], "weight_decay": group.get("weight_decay", 0.0)}


def _parameter_names(
    folder: Path, groups: list[dict], names: list[str], aliases: dict[str, str]
) -> dict[str, str]:
    """``{stored key: canonical parameter name}`` for every parameter the groups list."""
    listed = [p for group in groups for p in group.get("params", [])]
    if listed and all(isinstance(p, int) for p in listed):
        if listed != list(range(len(names))):
            raise CheckpointError(
                f"{folder} numbers its optimizer's parameters {listed[:4]}...; an optimizer "
                f"built from this model's parameters numbers its {len(names)} parameters "
                "0, 1, ... in one order: save get_optimizer_state_dict(model, optimizer), "
                "which keys them by name."
            )
        return {str(i): name for i, name in enumerate(names)}
    mapped = {}
    for key in listed:
        name = strip_wrappers(str(key))
        name = aliases.get(name, name)
        if name not in names:
            raise CheckpointError(
                f"{folder} holds optimizer state for {key!r}, which is no parameter of the model."
            )
        mapped[str(key)] = name
    return mapped


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def export_dcp(checkpoint: Checkpoint, out: Path) -> str:
    """Write ``checkpoint`` as a DCP folder at ``out`` (one process); the line to print."""
    import torch.distributed.checkpoint as dcp

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out} already exists and is not an empty folder; name a new folder or remove it."
        )
    state: dict[str, Any] = {"model": checkpoint.model_state()}
    groups = (checkpoint.manifest.get("optimizer") or {}).get("param_groups")
    if groups:
        per_name: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in checkpoint.tensors("optim"):
            name, _, state_key = key.rpartition("/")
            per_name.setdefault(name, {})[state_key] = tensor
        state["optim"] = {
            "state": per_name,
            "param_groups": [
                {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                for g in groups
            ],
        }
    staging = out.parent / f".{out.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)))
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(staging, out)
    carried = " and optimizer state" if groups else " (no optimizer state in the checkpoint)"
    return (
        f"wrote {out}: DCP folder of the model{carried}, step {checkpoint.step}; read it with "
        "torch.distributed.checkpoint.load({'model': model.state_dict()}, "
        f"checkpoint_id={str(out)!r})"
    )
