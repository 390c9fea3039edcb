"""The runner that executes a pipeline schedule given as data.

A schedule (``schedules``) is pure data: for each stage, the order of its forward and
backward passes of micro-batches. The runner walks this stage's list and calls the
stage's passes in that order, times each for the timeline, and books the link's buffers
in the memory ledger after each. It knows nothing of GPipe or 1F1B, and the engine
knows nothing of the order: a new schedule is a new list (registered in
``schedules.SCHEDULES``, checked by ``schedule_clock.simulate``), with no engine edit.

The engine supplies the passes (``StagePasses``; a training step's are
``step_passes.StepPasses``): run micro-batch ``m`` forward through this stage, or
backward, where the step's final backward (``last``) also carries the step's loss and
arms the replicas' gradient reduction. A zero-bubble schedule splits the
backward: ``B`` then computes the input's gradient only and ``W`` the weights'; the
step's last gradient is then a W's, so the last W is the one marked ``last`` (and what
must follow it, the loss handed back and the replicas' reduction, runs in
``after_last``, outside its timed pass; what needs only the step's forwards, the last
stage's loss leaving, runs after the last B, in ``after_last_input``). An
interleaved schedule gives a worker several chunks (virtual stages); each action names
its chunk, and each chunk has its own link, the last chunk's carrying the step's loss
back towards stage 0.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.pipeline.p2p import StageLink
from paratrain.parallel.pipeline.schedules import (
    Action,
    Schedule,
    ScheduleError,
    splits_backward,
)
from paratrain.parallel.pipeline.timeline import READY_KIND

EVENT_KINDS = {"F": "forward", "B": "backward", "W": "weight"}
"""An action's kind as the timeline names it."""


class StagePasses(Protocol):
    """What a stage does for one action; each returns when its computation started
    (after its input arrived), so that waiting shows as idle time on the timeline."""

    def forward(self, micro: int, chunk: int) -> float: ...

    def backward(self, micro: int, chunk: int, *, last: bool) -> float: ...

    def weight(self, micro: int, chunk: int, *, last: bool) -> float: ...

    def after_last(self) -> None:
        """After the step's last pass that makes gradients, once its event is recorded:
        what needs that pass done but must not delay it (a split backward's loss hand-
        back, which waits on the next stage, and the replicas' reduction)."""

    def after_last_input(self) -> None:
        """After the step's last B of a split backward, once its event is recorded: every
        forward of the step has run by then (a micro-batch's B follows its F), so what
        needs only the forwards (the last stage's loss) may leave before the W passes
        that follow."""


class ScheduleRunner:
    """One stage's part of a schedule, run once per round of micro-batches."""

    def __init__(
        self,
        schedule: Schedule,
        stage: int,
        *,
        links: list[StageLink],
        memory: MemoryTracker,
        events: list[dict[str, Any]],
    ) -> None:
        """``links``: one per chunk this stage holds, in chunk order."""
        self.actions: list[Action] = list(schedule[stage])
        beyond = [a for a in self.actions if a.chunk >= len(links)]
        if beyond:
            raise ScheduleError(
                f"the schedule gives stage {stage} action "
                f"{beyond[0].label(chunks=beyond[0].chunk + 1)}, but the stage holds "
                f"{len(links)} chunk(s); build the schedule with as many chunks as "
                "virtual_stages."
            )
        self.chunked = len(links) > 1
        ends = "W" if splits_backward(schedule) else "B"
        backwards = [i for i, a in enumerate(self.actions) if a.kind == ends]
        if not backwards:
            raise ScheduleError(f"the schedule gives stage {stage} no backward pass.")
        self.final_backward = backwards[-1]
        """The position of the stage's last pass that makes gradients (B, or W where the
        backward is split): the one that ends its round."""
        inputs = [i for i, a in enumerate(self.actions) if a.kind == "B"] if ends == "W" else []
        self.final_input = inputs[-1] if inputs else None
        """Where the backward is split, the position of the stage's last B."""
        self.links, self.memory, self.events = links, memory, events

    def run_round(self, passes: StagePasses, *, micro_batches: int, step: int, final: bool) -> None:
        """Every action of this stage, in the schedule's order (``step``: the step this
        round belongs to, for the timeline; ``final``: the step's last round)."""
        # when the stage was free for this round: a stage may still be busy with the last
        # step's passes and optimizer step when this step's first input comes (``flush``)
        self.events.append({"step": step, "kind": READY_KIND, "start": time.perf_counter()})
        for index, link in enumerate(self.links):
            link.begin_round(micro_batches, expect_loss=final and index == len(self.links) - 1)
        for position, action in enumerate(self.actions):
            last = final and position == self.final_backward
            if action.kind == "F":
                start = passes.forward(action.micro, action.chunk)
            elif action.kind == "B":
                start = passes.backward(action.micro, action.chunk, last=last)
            else:
                start = passes.weight(action.micro, action.chunk, last=last)
            event = {
                "step": step,
                "kind": EVENT_KINDS[action.kind],
                "micro": action.micro,
                "start": start,
                "end": time.perf_counter(),
            }
            if self.chunked:
                event["chunk"] = action.chunk
            self.events.append(event)
            self.memory.book_communication()
            if last:
                passes.after_last()
            elif final and position == self.final_input:
                passes.after_last_input()
        for link in self.links:
            link.flush()
