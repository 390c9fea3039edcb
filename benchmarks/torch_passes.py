"""torch.distributed.pipelining's passes timed, so that its bubble is measured as ours is.

Why: paratrain's bubble is judged against theory, and what it idles beyond theory is
either its engine's or the machine's (gloo's threads and two stage processes on a loaded
CPU delay messages by milliseconds at times). The peer's own idle, measured the same way
on the same machine in the same launch, tells the two apart. Each ``PipelineStage``'s
``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` is
wrapped to stamp its start and end: torch's schedules wait for a pass's input before
calling it, so a start falls after the input arrived, as paratrain's timeline stamps it,
and waiting shows as idle on both. Only the stage's own methods are wrapped (on the
instance): nothing in torch changes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from paratrain.parallel.pipeline.timeline import covered_seconds

PASS_METHODS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "weight",
}
"""The methods a torch schedule calls for a pass, and the timeline's name for each."""


class TorchPass(NamedTuple):
    step: int
    stage: int
    kind: str
    start: float
    end: float


class PassTimer:
    """One worker's record of its torch stages' passes, numbered by the step they ran in."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.step = 0
        """Set by the runner before each step."""
        self.passes: list[TorchPass] = []

    def wrap(self, pipe_stage: Any) -> None:
        for name, kind in PASS_METHODS.items():
            method = getattr(pipe_stage, name, None)
            if method is not None:  # torch before 2.5 has no split backward
                setattr(pipe_stage, name, self._timed(method, kind))

    def _timed(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self.passes.append(TorchPass(self.step, self.stage, kind, start, time.perf_counter()))
            return out

        return timed


class StepIdle(NamedTuple):
    bubble: float
    """The per-stage mean of idle over the step's span, as ``timeline.bubble_of``."""
    idle_s: float
    """The per-stage mean idle seconds."""
    busiest_idle_s: float
    """The idle seconds of the stage with the most work in the step."""


def step_idles(passes: Sequence[TorchPass], stages: int) -> list[StepIdle]:
    """Every step's idle, all workers' passes together (``time.perf_counter`` is the
    system's monotonic clock, shared by processes on one machine); the first step is left
    out, as paratrain's ``measured_steps`` leaves out its first."""
    steps = sorted({p.step for p in passes})
    idles = []
    for step in steps[1:] if len(steps) > 1 else steps:
        those = [p for p in passes if p.step == step]
        span = max(p.end for p in those) - min(p.start for p in those)
        busy = [
            covered_seconds([(p.start, p.end) for p in those if p.stage == s])
            for s in range(stages)
        ]
        bubble = statistics.fmean((span - b) / span for b in busy)
        idles.append(StepIdle(bubble, bubble * span, span - max(busy)))
    return idles


def median_idle(passes: Sequence[TorchPass], stages: int) -> StepIdle:
    """The bubble and idle seconds of the median step (as ``timeline.median_step`` picks
    it, the lower middle one), and the median of the busiest stage's idle seconds."""
    idles = step_idles(passes, stages)
    middle = sorted(idles)[(len(idles) - 1) // 2]
    busiest = statistics.median(i.busiest_idle_s for i in idles)
    return StepIdle(middle.bubble, middle.idle_s, busiest)
