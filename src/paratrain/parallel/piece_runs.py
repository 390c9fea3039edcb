"""A model cut at named blocks, measured piece by piece as the pipeline runs its pieces.

Lives outside the pipeline package so that the planner (which names no strategy) can
measure with it, as ``split_backward_kept`` does.

A model that is no layer list is cut by the pipeline before blocks of one ``ModuleList``
(``split_points``): a stage runs the model's own forward from its first block to the next
stage's (``stage_run.NamedStage``), the first stage also everything before the blocks
(embeddings), the last everything after them (final norm, head). The planner prices such
a pipeline from the costs of the pieces of the cut before every block (``every_block``):
piece ``i`` is block ``i``, the first and the last with what they hold beyond it. A stage
of consecutive pieces then holds, saves and takes what they add up to.

Every piece is measured through ``NamedStage`` itself, on a copy of the model that holds
only that piece (``PieceRun``), so that the embedding's and the head's work, their
parameters (a tied head's copy on the last stage included, as the engine holds it), their
live bytes and what a zero-bubble B keeps are the engine's own, a later stage's shape-only
run of the modules before its first block is paid as the engine pays it, and a block's
arguments that no layer list has (a Hugging Face key-value cache, made anew by each
forward) are made by the model's forward as on a stage rather than replayed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from paratrain.parallel.pipeline.split_backward import ChunkOwners
from paratrain.parallel.pipeline.split_points import (
    automatic_container,
    block_count,
    every_block,
    piece_param_counts,
)
from paratrain.parallel.pipeline.stage_run import NamedStage, argument_signature, tensors_in
from paratrain.parallel.split_backward_kept import kept_for_piece
from paratrain.parallel.split_backward_time import split_piece_pass

__all__ = ["PieceRun", "PieceRuns", "automatic_container", "block_count"]


class PieceRun(nn.Module):
    """One piece of the cut before every block, run as its pipeline stage runs it: called
    on the model's inputs (the first piece) or on the tensors the previous piece sends (any
    other), it returns what the stage returns. Its parameters are exactly the piece's (a
    ``ParameterList`` of the copy's own Parameters) and its buffers the stage's, so that
    what measures a layer by its parameters and buffers measures the piece."""

    def __init__(self, stage: NamedStage) -> None:
        super().__init__()
        self.held = nn.ParameterList([p for _, p in stage.named_parameters()])
        own = [b for b in stage.model.buffers() if b.device.type != "meta"]  # the rest: meta
        for index, buffer in enumerate(own):  # the same tensors, so counted as the stage's
            self.register_buffer(f"buffer_{index}", buffer, persistent=False)
        self._stage, self._inputs = stage, None

    def feed(self, inputs: Any) -> None:
        """The micro-batch a later piece runs the modules before it on (shape-only)."""
        self._inputs = inputs

    def forward(self, *received: torch.Tensor) -> Any:
        if self._stage.pieces[0] == 0:
            return self._stage.run(received[0])
        return self._stage.run(self._inputs, received=list(received))

    @contextmanager
    def split_pass(self, recorded: tuple[tuple, dict], autocast_of) -> Iterator[Callable]:
        """Its zero-bubble F, B and W as one call to time (``split_piece_pass``), with
        the owners its stage's W takes units by."""
        with (
            ChunkOwners(*self._stage.piece_owners(0)) as owners,
            split_piece_pass(self, recorded, owners, autocast_of) as triple,
        ):
            yield triple

    def kept_for_weight_pass(self, recorded: tuple[tuple, dict], autocast_of) -> int:
        """What its zero-bubble B keeps for W (``kept_for_piece``), with the owners its
        stage's W takes units by (``NamedStage.piece_owners``)."""
        with ChunkOwners(*self._stage.piece_owners(0)) as owners:
            return kept_for_piece(self, recorded, owners, autocast_of)


class PieceRuns:
    """The ``PieceRun`` of every piece of ``model`` cut before every block of
    ``container``, each on its own copy of the model (``NamedStage`` moves the rest of it
    to meta): the first and the last made at once, a middle one when first asked for and
    shared by every later block of its signature (class, sizes, parameter shapes and the
    shapes of the tensors it receives: a transformer's blocks), so that a model of n equal
    blocks makes three copies, not n."""

    def __init__(self, model: nn.Module, container: str, device: torch.device) -> None:
        self.model, self.device = model, device
        self.plan = every_block(model, container)
        self.blocks = list(model.get_submodule(container))
        self.last = self.plan.stages - 1
        self.ends = {piece: self._made(piece) for piece in (0, self.last)}
        self._middle: dict[Any, PieceRun] = {}

    def _made(self, piece: int) -> PieceRun:
        return PieceRun(NamedStage(copy.deepcopy(self.model), self.plan, [piece], self.device))

    def stand_ins(self, recorded: list[Any], inputs: Any) -> dict[int, tuple[PieceRun, Any]]:
        """Per piece, its run and what it is called on (as a layer's recorded input) for a
        micro-batch of ``inputs`` whose blocks' arguments the trace ``recorded``: the
        model's inputs for the first piece, the tensors among its first block's arguments
        (in the order ``NamedStage`` takes them) for a later one."""
        called = {}
        for piece, block in enumerate(self.blocks):
            if piece == 0:
                run, arguments = self.ends[0], (inputs,)
            else:
                run = self._run_of(piece, block, recorded[piece])
                arguments = tuple(tensors_in(recorded[piece]))
            run.feed(inputs)
            called[piece] = (run, (arguments, {}))
        return called

    def _run_of(self, piece: int, block: nn.Module, recorded: Any) -> PieceRun:
        if piece == self.last:
            return self.ends[piece]
        shapes = argument_signature(recorded)
        if shapes is None:  # an argument whose content could matter: measured on its own
            shapes = ("piece", piece)
        params = tuple((n, tuple(p.shape), p.requires_grad) for n, p in block.named_parameters())
        key = (type(block), repr(block), params, shapes)
        if key not in self._middle:
            self._middle[key] = self._made(piece)
        return self._middle[key]

    def holders(self) -> list[tuple[nn.Module, int]]:
        """Per piece, the module whose parameters its stage holds (the block, or the first
        or last ``PieceRun``), and the parameter count the engine's automatic cut balances
        it by (``piece_param_counts``)."""
        held = [self.ends.get(i, block) for i, block in enumerate(self.blocks)]
        counts = piece_param_counts(self.model, self.plan.container)
        return list(zip(held, counts, strict=True))
