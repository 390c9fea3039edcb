"""A pipeline schedule's data: actions, a stage's list of them, and what a pass costs on
the clock that proves the lists (``schedule_clock``) and builds them (``schedules``)."""

from __future__ import annotations

import string
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot be built or is malformed, said in one sentence."""


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one stage (or one chunk of it)."""

    kind: str
    """``"F"`` (forward), ``"B"`` (backward; of the input only where the schedule has
    ``W`` actions) or ``"W"`` (the weights' part of a split backward)."""
    micro: int
    """Micro-batch index."""
    chunk: int = 0
    """Virtual stage held by this device (interleaved schedules only)."""

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W"):
            raise ScheduleError(f"action kind must be 'F', 'B' or 'W', not {self.kind!r}.")

    def label(self, *, chunks: int = 1) -> str:
        """``F3``, or ``F3b`` (chunk 1) when the schedule has several chunks."""
        suffix = string.ascii_lowercase[self.chunk] if chunks > 1 else ""
        return f"{self.kind}{self.micro}{suffix}"


Schedule = list[list[Action]]


def stage_ticks(
    stage: int, forward: float, backward: float, weight: float, *, split: bool
) -> dict[str, float]:
    """Ticks per kind on ``stage``: a split backward's B takes ``backward - weight`` and
    its W ``weight``, but on the first stage (fed data, no input gradient to make) B takes
    none and W the whole ``backward``, as the engine runs it."""
    if not split:
        return {"F": forward, "B": backward}
    if stage == 0:
        return {"F": forward, "B": 0, "W": backward}
    return {"F": forward, "B": backward - weight, "W": weight}


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits its backward into B (input) and W (weights)."""
    return any(a.kind == "W" for actions in schedule for a in actions)
