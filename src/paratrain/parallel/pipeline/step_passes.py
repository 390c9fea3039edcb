"""One stage's passes of a training step: what the runner calls for each schedule action.

The engine (``engine``) builds the stage (its chunks and links, its replicas, its
optimizer) and steps the optimizer; this runs a step's rounds of micro-batches through the
stage. F receives (or takes) a micro-batch, runs a chunk and sends the result on; B waits
for the output's gradient and sends the input's; W, where the schedule splits the
backward, makes the weights' gradients (``split_backward``); and what must follow the
step's last pass runs after it (the loss handed back towards stage 0, the replicas'
reduction armed). Apart from the engine because this is where a step's state lives (the
loss totals, the activations held from F to B and W, the hooks of a round) and the part
every schedule exercises; it sees the stage only through ``StageParts``.

Each pass returns when its computation started, after its input arrived, so that waiting
for a neighbour shows as idle time on the timeline, not as work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.parallel.batching import split_micro, to_device
from paratrain.parallel.grad_buckets import BucketedGradientReducer
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.model_loss_items import part_inputs
from paratrain.parallel.pipeline import split_backward_limits
from paratrain.parallel.pipeline.chunks import Chunk
from paratrain.parallel.pipeline.p2p import StageLink
from paratrain.parallel.pipeline.runner import ScheduleRunner
from paratrain.parallel.pipeline.split_backward import ChunkOwners, LayerTape, graph_leaves
from paratrain.parallel.pipeline.structure import flatten, floating
from paratrain.parallel.precision import Precision
from paratrain.runtime.mesh import Mesh


def floating_leaves(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a stage boundary value, in the order messages use."""
    leaves, _ = flatten(value)
    return [leaves[index] for index in floating(leaves)]


def pass_loss_back(mesh: Mesh, link: StageLink, compute: Callable[[], Any]) -> torch.Tensor:
    """The last stage computes the loss; every other stage hears it from the next one and
    passes it on, so every rank knows it without a collective of its own (``link``: the
    last chunk's, along which the loss travels)."""
    loss = compute() if mesh.is_last else link.recv_loss()
    if not mesh.is_first:
        link.send_loss(loss)
    return loss


def _key(micro: int, chunk: int) -> int | tuple[int, int]:
    """The memory ledger's key of a micro-batch's pass through a chunk (the micro-batch
    alone for the first chunk, as plain schedules always keyed it)."""
    return micro if chunk == 0 else (micro, chunk)


@dataclass
class StageParts:
    """What a step's passes use of the stage, set up once by the engine."""

    chunks: list[Chunk]
    loss_link: StageLink
    """The last chunk's link: the step's loss travels along it."""
    mesh: Mesh
    device: torch.device
    memory: MemoryTracker
    precision: Precision
    runner: ScheduleRunner
    run_stage: Callable[..., Any]
    """``engine._run_stage``: a chunk's layers (or a named piece) on a micro-batch."""
    owners_of: Callable[[Chunk], ChunkOwners]
    """A chunk's parameter owners for a round of a split backward."""
    micro_batches: int
    """A round's micro-batches on each replica."""
    split_backward: bool
    recompute: bool
    needs_inputs: bool
    """Whether this stage runs from the batch's inputs (the first, or every stage of a
    model cut at split points)."""
    cut_chunks: set[int] = field(default_factory=set)
    """Chunks a split backward runs cut between layers: one micro-batch's graph failed the
    proof that lets W take the uncut chunk unit by unit (``LayerTape(whole=)``); kept
    from step to step."""


class StepPasses:
    """A training step's passes on this stage (``runner.StagePasses``), round by round."""

    def __init__(
        self,
        stage: StageParts,
        *,
        totals: LossTotals,
        loss_fn: Callable[..., Any],
        reducer: BucketedGradientReducer | None,
        items: int | None,
        parts: int,
    ) -> None:
        """``totals``: the step's losses (on the last stage); ``items``: the step's
        ``num_items_in_batch`` where the model takes it; ``parts``: the micro-batches of
        the whole job's step (accumulation rounds x micro-batches x replicas)."""
        self.stage, self.totals, self.loss_fn, self.reducer = stage, totals, loss_fn, reducer
        self.items, self.parts = items, parts
        self.scale = 1.0 / parts  # a mean's
        self.loss: torch.Tensor | None = None
        """The step's loss once handed back (the last pass, or the last stage's last B)."""
        self.micro_in: list[Any] = []
        self.micro_tgt: list[Any] = []
        self.held: dict[tuple[int, int], tuple[Any, Any, LayerTape | None]] = {}
        self.owners: list[ChunkOwners] | None = None
        """Each chunk's parameter owners for the round (a split backward's), hooked but for
        a chunk fed data, whose W is one whole backward and records nothing."""

    def run_round(self, inputs: Any, targets: Any, *, step: int, final: bool) -> None:
        """One pass of the schedule over the stage's micro-batches (``runner``)."""
        stage = self.stage
        micro = stage.micro_batches
        micro_in = split_micro(inputs, micro) if stage.needs_inputs else []
        self.micro_in = [part_inputs(x, self.items, self.parts, as_tensor=False) for x in micro_in]
        self.micro_tgt = split_micro(targets, micro) if stage.mesh.is_last else []
        self.held = {}
        with ExitStack() as hooked:
            self.owners = None
            if stage.split_backward:
                hooked.enter_context(split_backward_limits.explained())
                self.owners = [stage.owners_of(c) for c in stage.chunks]
                for chunk, owners in zip(stage.chunks, self.owners, strict=True):
                    if not chunk.first:  # fed data: its W is one whole backward, unrecorded
                        hooked.enter_context(owners)
            stage.runner.run_round(self, micro_batches=micro, step=step, final=final)

    def forward(self, micro: int, chunk: int) -> float:
        """Receive (or take) micro-batch ``micro``, run chunk ``chunk``, pass the result on."""
        stage, m, c = self.stage, micro, chunk
        part = stage.chunks[c]
        inputs = to_device(self.micro_in[m], stage.device) if stage.needs_inputs else None
        if part.first:
            x = inputs
        else:
            x = part.link.recv_activation(m)
            for leaf in floating_leaves(x):  # their gradients go back to the stage before
                leaf.requires_grad_(True)
        start = time.perf_counter()
        tape = None
        if stage.split_backward:
            owners = self.owners[c] if self.owners else None
            tape = LayerTape(whole=c not in stage.cut_chunks, owners=owners)
        with stage.memory.forward(_key(m, c)), stage.precision.autocast(stage.device):
            y = stage.run_stage(x, part, recompute=stage.recompute, inputs=inputs, tape=tape)
            if part.last:
                loss = self.totals.add(self.loss_fn(y, to_device(self.micro_tgt[m], stage.device)))
                loss_scale = stage.precision.loss_factor()
                y = self.totals.scaled(loss, stage.precision.loss_factor(self.scale), loss_scale)
        if tape is not None and not tape.whole:
            stage.cut_chunks.add(c)
        if not part.last:
            part.link.send_activation(y, m)
            part.link.expect_gradient(m, y)
        self.held[m, c] = (x, y, tape)
        return start

    def backward(self, micro: int, chunk: int, *, last: bool) -> float:
        """Backward of micro-batch ``micro`` once its output gradient arrived; send the
        input's. The step's last backward also passes the step's loss towards stage 0 and
        arms the gradient all-reduce across replicas, whose extra slot averages that loss
        too."""
        stage, m, c = self.stage, micro, chunk
        part = stage.chunks[c]
        x, y, tape = self.held[m, c] if stage.split_backward else self.held.pop((m, c))
        grad = None if part.last else part.link.recv_gradient(m)
        if last:
            self._hand_loss_back()
            if self.reducer is not None:  # the replicas' contributions add up to the loss
                self.reducer.arm(extras=self.loss)
        start = time.perf_counter()
        with stage.memory.recording(_key(m, c)):
            pairs = None
            if not part.last:
                leaves = zip(floating_leaves(y), grad, strict=True)
                pairs = [(out, g) for out, g in leaves if out.requires_grad]
            if tape is not None:
                _backward_input(tape, x, y, pairs)
            elif pairs is None:
                if y.requires_grad:
                    y.backward()
            elif pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if tape is None:
            stage.memory.release(_key(m, c))
        if not part.first:
            part.link.send_gradient(x, m)
        return start

    def weight(self, micro: int, chunk: int, *, last: bool) -> float:
        """W of a split backward: micro-batch ``micro``'s weight gradients through chunk
        ``chunk`` (the step's last W is followed by ``after_last``)."""
        _, _, tape = self.held.pop((micro, chunk))
        start = time.perf_counter()
        with self.stage.memory.recording(_key(micro, chunk)):
            tape.backward_weight()
        self.stage.memory.release(_key(micro, chunk))
        return start

    def after_last(self) -> None:
        """After the step's last W of a split backward: take the step's loss from the next
        stage and pass it towards stage 0 (the last stage sent it at its last B,
        ``after_last_input``), and arm the replicas' reduction, now that every gradient
        exists (each layer's W is a backward of its own, so a Parameter used by two
        layers would count down its bucket twice while armed). After the W, not before
        it: waiting for the loss first held this stage's last W back by up to a W (on a
        2-stage gpt under ZB-H1, 15 ms of a 450 ms step, when the loss left the last
        stage after its own last W)."""
        if not self.stage.split_backward:
            return  # a backward that is not split passed the loss and armed at its start
        if self.loss is None:  # the last stage's left at its last B
            self._hand_loss_back()
        if self.reducer is not None:
            self.reducer.arm(extras=self.loss)

    def after_last_input(self) -> None:
        """After the step's last B of a split backward: the last stage hands the step's
        loss back now, all its forwards having run, and not after the W passes that
        follow. The stage before receives it after its own last W, as before; sent after
        this stage's last W, it kept that stage waiting whenever this stage's W passes
        ended later (on a 2-stage ZB-H2 the last stage runs two W after its last B, the
        first stage one longer W: the first stage's step ended 3.3-4.2 ms after its last
        pass, 1.9 ms now, torch's 2.2-2.6; the last stage waits that long again for the
        next step's first forward)."""
        if self.stage.mesh.is_last:
            self._hand_loss_back()

    def _hand_loss_back(self) -> None:
        self.loss = pass_loss_back(self.stage.mesh, self.stage.loss_link, self.totals.contribution)


def _backward_input(tape: LayerTape, x: Any, y: Any, pairs: list | None) -> None:
    """B of a split backward: the input's gradients into the received tensors' ``.grad``
    (which ``send_gradient`` reads); the weights' wait for W (``pairs``: the outputs'
    gradients, None on the last chunk, whose ``y`` is the loss)."""
    if pairs is None:
        grads = tape.backward_input_from_loss(y) if y.requires_grad else []
    else:
        by_output = {id(out): g for out, g in pairs}
        grads = tape.backward_input([by_output[id(out)] for out in tape.outputs])
    received = [] if x is None else graph_leaves(x)
    for leaf, grad in zip(received, grads, strict=False):
        leaf.grad = grad
