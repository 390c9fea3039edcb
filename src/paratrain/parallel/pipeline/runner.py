"""The runner that executes a pipeline schedule given as data.

A schedule (``schedules``) is pure data: for each stage, the order of its forward and
backward passes of micro-batches. The runner walks this stage's list and calls the
stage's passes in that order, times each for the timeline, and books the link's buffers
in the memory ledger after each. It knows nothing of GPipe or 1F1B, and the engine
knows nothing of the order: a new schedule is a new list (registered in
``schedules.SCHEDULES``, checked there by ``simulate``), with no engine edit.

The engine supplies the passes (``StagePasses``): run micro-batch ``m`` forward through
this stage, or backward, where the step's final backward (``last``) also carries the
step's loss and arms the replicas' gradient reduction. Actions of a second chunk
(interleaved schedules, several virtual stages per worker) are refused: a stage here
holds one contiguous slice of the model.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.pipeline.p2p import StageLink
from paratrain.parallel.pipeline.schedules import Action, Schedule, ScheduleError

EVENT_KINDS = {"F": "forward", "B": "backward"}
"""An action's kind as the timeline names it."""


class StagePasses(Protocol):
    """What a stage does for one action; each returns when its computation started
    (after its input arrived), so that waiting shows as idle time on the timeline."""

    def forward(self, micro: int) -> float: ...

    def backward(self, micro: int, *, last: bool) -> float: ...


class ScheduleRunner:
    """One stage's part of a schedule, run once per round of micro-batches."""

    def __init__(
        self,
        schedule: Schedule,
        stage: int,
        *,
        link: StageLink,
        memory: MemoryTracker,
        events: list[dict[str, Any]],
    ) -> None:
        self.actions: list[Action] = list(schedule[stage])
        chunked = [a for a in self.actions if a.chunk != 0]
        if chunked:
            raise ScheduleError(
                f"the schedule gives stage {stage} action {chunked[0].label(chunks=2)} of "
                "a second chunk, but each pipeline stage holds one slice of the model; "
                "choose a schedule with one chunk per stage (gpipe or 1f1b)."
            )
        backwards = [i for i, a in enumerate(self.actions) if a.kind == "B"]
        if not backwards:
            raise ScheduleError(f"the schedule gives stage {stage} no backward pass.")
        self.final_backward = backwards[-1]
        """The position of the stage's last backward: the one that ends its round."""
        self.link, self.memory, self.events = link, memory, events

    def run_round(self, passes: StagePasses, *, micro_batches: int, step: int, final: bool) -> None:
        """Every action of this stage, in the schedule's order (``step``: the step this
        round belongs to, for the timeline; ``final``: the step's last round)."""
        self.link.begin_round(micro_batches, expect_loss=final)
        for position, action in enumerate(self.actions):
            if action.kind == "F":
                start = passes.forward(action.micro)
            else:
                last = final and position == self.final_backward
                start = passes.backward(action.micro, last=last)
            self.events.append(
                {
                    "step": step,
                    "kind": EVENT_KINDS[action.kind],
                    "micro": action.micro,
                    "start": start,
                    "end": time.perf_counter(),
                }
            )
            self.memory.book_communication()
        self.link.flush()
