"""One zero-bubble pass triple (F, B, W) of a layer or a piece, ready to be timed by the planner.

A backward split in two costs more than one backward: the forward records each parameter-
owning module's calls (``weight_units``), B walks the graph to the input and to those
modules' outputs keeping it alive (``retain_graph``), and W walks it again, module by
module. On a CPU that is milliseconds a micro-batch for a small block (the bench's
2-stage gpt: torch's and paratrain's zero-bubble steps both 15-20% slower than their
1F1B), so a planner that priced B and W as the two halves of one backward ranked the
zero-bubble schedules above 1F1B where they ran slower. These functions run the
pipeline's own ``LayerTape`` as a stage does, so what is timed is the engine's split,
not a derivation of it. They live outside the pipeline package so that the planner's
measurement (which names no strategy) can call them, as ``split_backward_kept`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from paratrain.parallel.layer_profile import fresh_leaves, tensors_in
from paratrain.parallel.pipeline.split_backward import ChunkOwners, LayerTape
from paratrain.parallel.pipeline.weight_units import graph_tensors

__all__ = ["split_layer_pass", "split_piece_pass"]


@contextmanager
def split_layer_pass(
    layer: nn.Module, recorded: tuple[tuple, dict], autocast_of: Callable[[], Any]
) -> Iterator[Callable[[], None]]:
    """A function that runs ``layer``'s F, B and W once on its recorded input, made to
    need a gradient as a later stage's received input does (the engine's ``LayerTape``,
    the chunk uncut with its units recorded and proved, ``whole``), B from gradients of
    ones. Its parameters' owners are hooked once for all the calls, as the engine hooks
    them once a round; the parameters' ``.grad`` (which W accumulates into) are as they
    were on leaving."""
    args, kwargs = recorded
    with ChunkOwners.of_layers([layer]) as owners, _grads_restored(layer):

        def run(tape: LayerTape) -> None:
            tape.run([layer], fresh_leaves(args), kwargs)

        yield _one_triple(owners, run, autocast_of)


@contextmanager
def split_piece_pass(
    piece: nn.Module,
    recorded: tuple[tuple, dict],
    owners: ChunkOwners,
    autocast_of: Callable[[], Any],
) -> Iterator[Callable[[], None]]:
    """``split_layer_pass`` of a piece of a model cut at named blocks, run as its stage
    runs it (``LayerTape.run_piece`` with the piece's parameter ``owners``, entered):
    ``piece`` is called on the recorded tensors."""
    args, kwargs = recorded
    with _grads_restored(piece):

        def run(tape: LayerTape) -> None:
            received = fresh_leaves(args)
            needs = [t for t in tensors_in(received) if t.requires_grad]
            tape.run_piece(lambda: piece(*received, **kwargs), needs, leaves_of=graph_tensors)

        yield _one_triple(owners, run, autocast_of)


def _one_triple(
    owners: ChunkOwners, run: Callable[[LayerTape], None], autocast_of: Callable[[], Any]
) -> Callable[[], None]:
    def triple() -> None:
        tape = LayerTape(whole=True, owners=owners)
        with torch.enable_grad(), autocast_of():
            run(tape)
        if not tape.outputs:
            return
        tape.backward_input([torch.ones_like(t) for t in tape.outputs])
        tape.backward_weight()

    return triple


@contextmanager
def _grads_restored(module: nn.Module) -> Iterator[None]:
    """The parameters' ``.grad`` as they were before: W accumulates into them, and the
    planner measures the user's own model."""
    params = list(module.parameters())
    before = [p.grad for p in params]
    try:
        yield
    finally:
        for param, grad in zip(params, before, strict=True):
            param.grad = grad
