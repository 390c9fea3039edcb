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
from paratrain.parallel.pipeline.split_backward import ChunkOwners, LayerTape
from paratrain.parallel.pipeline.weight_units import graph_tensors
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

    def run(tape: LayerTape) -> None:
        tape.run([layer], fresh_leaves(args), kwargs)

    excluded = [*layer.parameters(), *layer.buffers(), *tensors_in([args, kwargs])]
    return _kept_after_input_pass(LayerTape(), run, excluded, autocast_of)


def kept_for_piece(
    piece: nn.Module,
    recorded: tuple[tuple, dict],
    owners: ChunkOwners,
    autocast_of: Callable[[], Any],
) -> int:
    """``kept_for_weight_pass`` of a piece of a model cut at named blocks, run as its
    stage runs it (``LayerTape.run_piece`` with the piece's parameter ``owners``, entered):
    ``piece`` is called on the recorded tensors."""
    args, kwargs = recorded

    def run(tape: LayerTape) -> None:
        received = fresh_leaves(args)
        needs = [t for t in tensors_in(received) if t.requires_grad]
        tape.run_piece(lambda: piece(*received, **kwargs), needs, leaves_of=graph_tensors)

    excluded = [*piece.parameters(), *piece.buffers(), *tensors_in([args, kwargs])]
    return _kept_after_input_pass(LayerTape(owners=owners), run, excluded, autocast_of)


def _kept_after_input_pass(
    tape: LayerTape, run: Callable[[LayerTape], None], excluded: list, autocast_of
) -> int:
    """Bytes live after B beyond what ``run``'s forward on ``tape`` left (``excluded``:
    storages the count leaves out); 0 where the forward took no input needing a gradient."""
    with LiveTensors() as live:
        live.exclude(excluded)
        with torch.enable_grad(), autocast_of():
            run(tape)
        if not tape.outputs or not tape.layers[0].inputs:
            return 0
        before = live.current
        grads = [torch.ones_like(t) for t in tape.outputs]
        found = tape.backward_input(grads)
        del grads, found
        return max(0, live.current - before)
