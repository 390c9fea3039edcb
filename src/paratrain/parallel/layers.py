"""A model as an ordered list of layers, and the canonical names of a slice of it.

Pipeline stages (and later per-layer sharding) cut a model at layer boundaries. A model
qualifies if it is an ``nn.Sequential`` or holds one as ``.layers`` and nothing else with
parameters. A stage keeps a slice of the layers under local indices; ``LayerSlice`` maps
its state-dict keys back to the names the single-device model uses, so checkpoints never
depend on how the model was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class LayerListError(ValueError):
    """The model cannot be seen as an ordered list of layers."""


def layer_list(model: nn.Module) -> tuple[nn.Sequential, str]:
    """The model's layer list and the state-dict prefix of its entries."""
    if isinstance(model, nn.Sequential):
        return model, ""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.Sequential):
        outside = [name for name, _ in model.named_parameters() if not name.startswith("layers.")]
        if not outside:
            return layers, "layers."
    raise LayerListError(
        f"{type(model).__name__} is not a layer list (an nn.Sequential, or a module whose "
        "parameters all live in an nn.Sequential attribute `layers`); rewrite the model as "
        "nn.Sequential(embedding, *blocks, norm, head)."
    )


def is_layer_list(model: nn.Module) -> bool:
    """Whether ``model`` can be seen as its layer list (``layer_list``)."""
    try:
        layer_list(model)
    except LayerListError:
        return False
    return True


class _HeldKeys:
    """A state dict between the held layers' local keys and the full model's: the
    subclass says how one key maps (``canonical``, and ``local``: None where not held)."""

    def canonical(self, local_key: str) -> str:
        raise NotImplementedError

    def local(self, canonical_key: str) -> str | None:
        raise NotImplementedError

    def to_canonical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.canonical(key): value for key, value in state.items()}

    def from_canonical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        picked = {}
        for key, value in state.items():
            local = self.local(key)
            if local is not None:
                picked[local] = value
        return picked


@dataclass(frozen=True)
class LayerSlice(_HeldKeys):
    """Layers ``[start, end)`` of a layer list whose keys carry ``prefix``."""

    start: int
    end: int
    prefix: str = ""

    def canonical(self, local_key: str) -> str:
        """``'0.weight'`` in the stage -> ``'<prefix><start>.weight'`` in the full model."""
        index, _, rest = local_key.partition(".")
        return f"{self.prefix}{self.start + int(index)}.{rest}"

    def local(self, canonical_key: str) -> str | None:
        """The stage's key for a full-model key, or None when the key is not in this slice."""
        if not canonical_key.startswith(self.prefix):
            return None
        index, _, rest = canonical_key[len(self.prefix) :].partition(".")
        if not index.isdigit() or not self.start <= int(index) < self.end:
            return None
        return f"{int(index) - self.start}.{rest}"


@dataclass(frozen=True)
class LayerPieces(_HeldKeys):
    """Layers at ``indices`` of a layer list (several non-adjacent runs of it, as a worker
    of an interleaved pipeline holds), kept under local indices ``0 .. len(indices) - 1``
    in that order; keys carry ``prefix``. One run ``range(start, end)`` is ``LayerSlice``."""

    indices: tuple[int, ...]
    prefix: str = ""

    def canonical(self, local_key: str) -> str:
        """``'2.weight'`` held -> ``'<prefix><indices[2]>.weight'`` in the full model."""
        index, _, rest = local_key.partition(".")
        return f"{self.prefix}{self.indices[int(index)]}.{rest}"

    def local(self, canonical_key: str) -> str | None:
        """The held key for a full-model key, or None when the layer is not held here."""
        if not canonical_key.startswith(self.prefix):
            return None
        index, _, rest = canonical_key[len(self.prefix) :].partition(".")
        if not index.isdigit() or int(index) not in self.indices:
            return None
        return f"{self.indices.index(int(index))}.{rest}"
