"""What a zero-bubble schedule's B leaves alive for a layer's W, measured for the planner.

Lives outside the pipeline package so that the planner's measurement (which names no
strategy) can call it; it runs the pipeline's own ``LayerTape`` so the figure is the
engine's, not a derivation of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.parallel.layer_profile import fresh_leaves, tensors_in
from paratrain.parallel.pipeline.split_backward import LayerTape
from paratrain.runtime.live_tensors import LiveTensors


def kept_for_weight_pass(
    layer: nn.Module, recorded: tuple[tuple, dict], autocast_of: Callable[[], Any]
) -> int:
    """Bytes a split backward's B leaves alive for ``layer``'s W beyond what its forward
    left (``split_backward.LayerTape`` on the recorded input, made to need a gradient as
    a stage's received input does; ``LiveTensors``): the gradients it keeps for W, and
    whatever else B's walk leaves behind: measured, so that what a derivation would not
    name is counted too. 0 for a layer with no floating input (a stage's first layer fed
    data keeps its output's gradient, which ``split_cost`` counts itself)."""
    args, kwargs = recorded
    with LiveTensors() as live:
        live.exclude([*layer.parameters(), *layer.buffers(), *tensors_in([args, kwargs])])
        a = fresh_leaves(args)
        tape = LayerTape()
        with torch.enable_grad(), autocast_of():
            tape.run([layer], a, kwargs)
        if not tape.outputs or not tape.layers[0].inputs:
            return 0
        before = live.current
        grads = [torch.ones_like(t) for t in tape.outputs]
        found = tape.backward_input(grads)
        del grads, found
        return max(0, live.current - before)
