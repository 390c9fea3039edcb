"""Activation recompute for whole-model engines: the layer list checkpointed by segment.

With ``recompute=True`` a replica keeps, between forward and backward, only the input of
each segment of the model's layer list; backward reruns one segment at a time to get the
rest back (``torch.utils.checkpoint``, non-reentrant: it handles inputs that need no
gradient, such as token ids, and replays the RNG and autocast state, so results are
unchanged). Saved activations drop from everything every layer saves to the segment
inputs, for about one extra forward's compute.

Segments: each layer with parameters starts one, and the parameter-free layers after it
(an activation, a reshape) join it. Why not every layer alone: a separate checkpoint per
ReLU would hold its input as well as its output, more than no recompute at all (measured
on the mlp: 4.1 KB against 2.6 KB). A segment input is what its first layer (a linear, a
norm, a block) saves anyway, so recompute never holds more than the plain run. Why not
the whole model as one segment: backward would recompute, and hold, every layer's
activations at once, the very peak recompute is meant to remove.

The layers are run in order, as the pipeline engine does: the model *is* its layer list
(see ``layers.layer_list``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from paratrain.parallel.layers import layer_list
from paratrain.parallel.options import StrategyOption

RECOMPUTE = StrategyOption(
    "recompute",
    bool,
    False,
    "recompute activations in backward: keep each layer's input only",
)
"""The option every engine that runs the layer list declares (one meaning for all)."""


def segments(layers: nn.Sequential) -> list[nn.Sequential]:
    """Consecutive runs of layers, each starting at a layer with parameters."""
    runs: list[list[nn.Module]] = []
    for layer in layers:
        has_parameters = next(layer.parameters(), None) is not None
        if not runs or has_parameters:
            runs.append([])
        runs[-1].append(layer)
    return [nn.Sequential(*run) for run in runs]


def refuse_batchnorm(layers: nn.Module) -> None:
    """Refuse recompute for layers holding BatchNorm: the recompute is a second training
    forward, which would update the running statistics a second time."""
    norms = [name for name, module in layers.named_modules() if isinstance(module, _BatchNorm)]
    if norms:
        raise ValueError(
            f"recompute=True would update the running statistics of BatchNorm layer "
            f"{norms[0]!r} twice per step (forward and recompute); use recompute=False "
            "for this model."
        )


def recomputing_forward(model: nn.Module) -> Callable[[Any], Any]:
    """``model``'s forward with each segment's activations recomputed in backward."""
    layers, _ = layer_list(model)
    refuse_batchnorm(layers)

    parts = segments(layers)  # new containers around the same layers: names unchanged

    def forward(inputs: Any) -> Any:
        for part in parts:
            inputs = checkpoint(part, inputs, use_reentrant=False)
        return inputs

    return forward
