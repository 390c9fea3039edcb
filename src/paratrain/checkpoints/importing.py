"""Weights saved elsewhere made a paratrain checkpoint (``paratrain ckpt import``).

The source is anything ``load_model_state`` reads (a ``.pt``/``.pth``/``.bin`` state dict,
perhaps from ``nn.DataParallel`` or DDP with ``module.`` names, a ``.safetensors`` file, a
paratrain checkpoint or run folder). It is checked, name by name and shape by shape,
against the model it is for (on the meta device: no weights are made), stored in that
model's dtypes with tied names stored once, and saved model-only: a resume from it starts
the optimizer fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.format import CheckpointError, save_model_state
from paratrain.checkpoints.model_state import load_model_state, strip_wrappers
from paratrain.parallel.ties import tied_names


@dataclass(frozen=True)
class Imported:
    """What an import wrote, as the command reports it."""

    tensors: int
    values: int
    """Values stored, a tied tensor counted once."""
    renamed: list[str]
    """Source names read under another name (wrapper prefixes stripped)."""

    def renamed_note(self) -> str:
        """`` ('module.x' read as 'x', ...)`` where names were renamed; else nothing."""
        if not self.renamed:
            return ""
        first = self.renamed[0]
        return f" ({first!r} read as {strip_wrappers(first)!r}, ...)"


def import_weights(
    source: Path,
    model: nn.Module,
    out: Path,
    metadata: dict[str, Any],
    optimizer: tuple[dict[str, torch.Tensor], list[dict[str, Any]]] | None = None,
) -> Imported:
    """Check ``source``'s weights against ``model`` and save them at ``out`` with
    ``metadata`` (and the optimizer state a DCP folder brought, ``dcp_format``); refuses
    tied names whose values differ."""
    stored = load_model_state(source)
    state = load_model_state(source, model=model)  # wrappers stripped, names/shapes checked
    expected = model.state_dict()
    state = {name: tensor.to(expected[name].dtype) for name, tensor in state.items()}
    ties = tied_names(model)
    for alias, canonical in ties.items():
        if not torch.equal(state[alias], state[canonical]):
            raise CheckpointError(
                f"{source} holds different values for {canonical!r} and {alias!r}, which "
                "this model ties: it was saved from a model without the tie; drop "
                "--tie-embeddings."
            )
        state[alias] = state[canonical]  # one tensor: stored once, the alias recorded
    save_model_state(out, state, metadata=metadata, optimizer=optimizer)
    values = sum(t.numel() for name, t in state.items() if name not in ties)
    return Imported(len(state), values, sorted(set(stored) - set(state)))
