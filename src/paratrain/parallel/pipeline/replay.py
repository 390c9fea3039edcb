"""The schedule replayed on measured times: the bubble a run's own stages imply.

The textbook bubbles (``timeline.schedule_bubble``: ``(p-1)/(m+p-1)`` and its kin) assume
that every stage takes the same time for each kind of pass and that messages are free. A
layer split is rarely equal in time (the last stage computes the loss, the first stage's
backward makes no input gradient) and a message over gloo takes time (0.01-0.1 ms on the
bench's 2-core machine, milliseconds under load), so a run can idle far more than the
textbook says with nothing wrong in the engine.
``replay`` places the schedule's own action lists by the simulator's rules
(``schedule_clock.place_actions``: each pass as early as its stage and its inputs allow, the
same dependencies, the same deadlock check) with a duration in seconds per (stage, chunk,
kind) and a message time added to every dependency between two devices;
``replayed_bubble`` is then the idle fraction that schedule must have on those stages.

``timeline_replay`` takes those times from a run's timeline: the median duration of each
(stage, chunk, kind) and the median delay of a message a stage was seen waiting for. It is
the schedule's own theory for the stages this run actually had, so measured/replayed near 1
says the engine adds nothing the schedule does not cost. What it cannot see: stages that
contend for cores (more workers than cores, or gloo's threads) run slower while others run,
which the medians average in, and a wait for a core looks like a wait for a message.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from paratrain.parallel.pipeline.schedule_clock import dependencies, place_actions
from paratrain.parallel.pipeline.schedules import Action, Schedule, ScheduleError, build_schedule
from paratrain.parallel.pipeline.timeline import (
    WORK_KINDS,
    StageEvent,
    Timeline,
    TimelineError,
    bubble_of,
    measured_steps,
    step_profile,
)

__all__ = [
    "Durations",
    "PassGap",
    "Replay",
    "Slot",
    "TimelineReplay",
    "engine_gaps",
    "message_time",
    "replay",
    "replayed_bubble",
    "replayed_theory",
    "stage_durations",
    "step_replay",
    "stepwise_ratios",
    "stepwise_theory",
    "timeline_replay",
]

Key = tuple[int, int, str]
"""``(stage, chunk, kind)`` with ``kind`` an action's ``"F"``, ``"B"`` or ``"W"``."""
Durations = Mapping[Key, float] | Callable[[int, int, str], float]
"""Seconds of one pass of ``kind`` on ``(stage, chunk)``: a mapping or a function."""

LETTER = dict(zip(WORK_KINDS, "FBW", strict=True))
"""A timeline's event kind -> the schedule's action kind."""


@dataclass(frozen=True)
class Slot:
    """An action placed in seconds: it runs from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Replay:
    """A schedule placed on given times: each stage's slots, busy seconds and the span."""

    slots: list[list[Slot]]
    busy: list[float]
    """Seconds each stage computes (its slots never overlap)."""
    makespan: float
    """From the first start to the last end, over all stages."""

    @property
    def bubble(self) -> float:
        """Mean over stages of idle / makespan, as ``timeline.measured_bubble`` defines it."""
        return statistics.fmean((self.makespan - b) / self.makespan for b in self.busy)

    @property
    def imbalance(self) -> float:
        """The slowest stage's busy seconds over the fastest's (1.0: equal stages)."""
        return max(self.busy) / min(self.busy)


def _seconds(durations: Durations) -> Callable[[int, Action], float]:
    """``durations`` as place_actions' length, each value checked when first asked."""

    def length(stage: int, action: Action) -> float:
        key = (stage, action.chunk, action.kind)
        if callable(durations):
            value = durations(*key)
        elif key in durations:
            value = durations[key]
        else:
            raise ScheduleError(f"no duration given for (stage, chunk, kind) {key}.")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ScheduleError(f"the duration of {key} must be a number, not {value!r}.")
        if not math.isfinite(value) or value < 0:
            raise ScheduleError(f"the duration of {key} must be finite and >= 0, not {value}.")
        return float(value)

    return length


def replay(schedule: Schedule, durations: Durations, *, hop_s: float = 0.0) -> Replay:
    """Place ``schedule`` with ``durations`` and ``hop_s`` seconds on every dependency
    that crosses from one device to another (``F(j-1) -> F(j)``, ``B(j+1) -> B(j)`` where
    the virtual stages sit on different devices; passes on one device wait for nothing
    more than their order). Raises ``ScheduleDeadlock`` on a list that cannot complete."""
    if isinstance(hop_s, bool) or not isinstance(hop_s, int | float):
        raise ScheduleError(f"hop_s must be a number of seconds, not {hop_s!r}.")
    if not math.isfinite(hop_s) or hop_s < 0:
        raise ScheduleError(f"hop_s must be finite and >= 0, not {hop_s}.")
    return _as_replay(place_actions(schedule, _seconds(durations), hop=float(hop_s)))


def _as_replay(placed: list) -> Replay:
    slots = [[Slot(action, start, end) for action, start, end in row] for row in placed]
    first = min(slot.start for row in slots for slot in row)
    makespan = max(slot.end for row in slots for slot in row) - first
    if makespan <= 0:
        raise ScheduleError("every duration is zero, so the replay spans no time.")
    busy = [sum(slot.end - slot.start for slot in row) for row in slots]
    return Replay(slots=slots, busy=busy, makespan=makespan)


def replayed_bubble(schedule: Schedule, durations: Durations, *, hop_s: float = 0.0) -> float:
    """The idle fraction ``schedule`` must have with these times (``replay(...).bubble``)."""
    return replay(schedule, durations, hop_s=hop_s).bubble


# ---------------------------------------------------------------------------- from a run


@dataclass(frozen=True)
class TimelineReplay:
    """A run's schedule replayed on its own median pass times and message time."""

    durations: dict[Key, float]
    hop_s: float
    replay: Replay

    @property
    def bubble(self) -> float:
        return self.replay.bubble


def schedule_of(timeline: Timeline) -> Schedule:
    """The action lists the run's stages ran (its meta line: schedule, sizes, ``flush``)."""
    return build_schedule(
        timeline.schedule,
        timeline.stages,
        timeline.micro_batches,
        timeline.virtual_stages,
        flush=timeline.flush,
    )


def round_events(
    timeline: Timeline, schedule: Schedule, step: int, replica: int
) -> list[list[StageEvent]]:
    """One step's events per stage in start order; refused unless the step ran the
    schedule once (a step of several rounds repeats its passes, which one replay cannot
    match)."""
    events = timeline.step_events(step, replica=replica)
    rows = [
        sorted((e for e in events if e.stage == s), key=lambda e: e.start)
        for s in range(len(schedule))
    ]
    for stage, (row, actions) in enumerate(zip(rows, schedule, strict=True)):
        if len(row) != len(actions):
            raise TimelineError(
                f"Step {step} of replica {replica} has {len(row)} passes on stage {stage} "
                f"where one round of its schedule has {len(actions)}; the replay matches one "
                "round per step, so time it with gradient_accumulation=1."
            )
    return rows


def stage_durations(timeline: Timeline, replica: int = 0) -> dict[Key, float]:
    """Median seconds of each ``(stage, chunk, kind)`` over the measured steps (all but
    the first, ``measured_steps``), kinds as the schedule names them (F, B, W)."""
    schedule = schedule_of(timeline)
    seen: dict[Key, list[float]] = {}
    for step in measured_steps(timeline, replica):
        for row in round_events(timeline, schedule, step, replica):
            for e in row:
                seen.setdefault((e.stage, e.chunk, LETTER[e.kind]), []).append(e.duration)
    return {key: statistics.median(values) for key, values in sorted(seen.items())}


def message_time(timeline: Timeline, replica: int = 0) -> float:
    """The median delay of a message a stage was seen waiting for, in seconds (0 if none).

    A pass that depends on another device's pass (``F(j-1) -> F(j)``, ``B(j+1) -> B(j)``)
    counts when its stage was waiting: its own previous pass of the step ended no later
    than the sender's pass did, so the stage sat free until the message came, and the
    delay is the receiver's start minus the sender's end (the receiver stamps its start
    after the message arrived). A stage's first pass of a step is left out: what it did
    before (the previous step's optimizer update, another program between steps) is not
    on the timeline. The sender stamps its end after its send returns, so one delay can
    come out a little below zero; the median is kept at zero then, a message taking no
    less than no time.
    """
    schedule = schedule_of(timeline)
    delays = []
    for step in measured_steps(timeline, replica):
        rows = round_events(timeline, schedule, step, replica)
        delays += _waits(rows, timeline.virtual_stages, f"Step {step} of replica {replica}")
    return max(statistics.median(delays), 0.0) if delays else 0.0


def _passes_with_inputs(
    rows: list[list[StageEvent]], chunks: int, where: str
) -> Iterator[tuple[int, StageEvent | None, StageEvent, list[tuple[StageEvent, bool]]]]:
    """Each pass of one step's rows as ``(stage, previous, pass, inputs)``: its stage's
    previous pass of the step (None for the first), and each pass it depends on with
    whether that one was made on another device (so came by a message). Refused where a
    pass it waits for is not in the step."""
    stages = len(rows)
    made = {(LETTER[e.kind], e.chunk * stages + e.stage, e.micro): e for row in rows for e in row}
    for stage, row in enumerate(rows):
        for previous, e in zip([None, *row[:-1]], row, strict=True):
            inputs = []
            for dep in dependencies(
                stage, Action(LETTER[e.kind], e.micro, e.chunk), stages, stages * chunks
            ):
                if dep not in made:
                    raise TimelineError(
                        f"{where} has {e.kind} {e.micro} on stage {stage} but not the pass "
                        f"it waits for, {dep}."
                    )
                inputs.append((made[dep], dep[1] % stages != stage))
            yield stage, previous, e, inputs


def _waits(rows: list[list[StageEvent]], chunks: int, where: str) -> list[float]:
    """One step's delays between a sender's end and a waiting receiver's start."""
    delays = []
    for _, previous, e, inputs in _passes_with_inputs(rows, chunks, where):
        if previous is None:
            continue  # what the stage did before its first pass is not on the timeline
        for sender, remote in inputs:
            if remote and previous.end <= sender.end:
                delays.append(e.start - sender.end)
    return delays


def timeline_replay(timeline: Timeline, replica: int = 0) -> TimelineReplay:
    """The run's schedule replayed on ``stage_durations`` and ``message_time``."""
    durations = stage_durations(timeline, replica)
    hop = message_time(timeline, replica)
    return TimelineReplay(durations, hop, replay(schedule_of(timeline), durations, hop_s=hop))


def step_replay(timeline: Timeline, step: int, replica: int = 0, *, hop_s: float = 0.0) -> Replay:
    """One step's schedule replayed on that step's own passes, each lasting what it
    measured, with ``hop_s`` per message: the idle time this schedule must have with
    exactly these pass times. A run's passes vary from one micro-batch to the next (on a
    shared CPU, by milliseconds), and a late pass makes its neighbours wait more than a
    replay on median times shows; this replay keeps that wait as the schedule's own, so
    what the run idles beyond it is the engine's (the gaps it leaves between passes)."""
    schedule = schedule_of(timeline)
    rows = round_events(timeline, schedule, step, replica)
    took = {(e.stage, e.chunk, LETTER[e.kind], e.micro): e.duration for row in rows for e in row}

    def length(stage: int, action: Action) -> float:
        return took[stage, action.chunk, action.kind, action.micro]

    first = rows[0][0].start  # stage 0's first pass: fed data, it starts the step
    release = [max(0.0, ready - first) for ready in _ready_times(timeline, step, replica)]
    return _as_replay(place_actions(schedule, length, hop=hop_s, release=release))


def _ready_times(timeline: Timeline, step: int, replica: int) -> list[float]:
    """When each stage began ``step`` (``Timeline.ready``; minus infinity where the
    timeline does not say, an older file): under steps run back to back a later stage
    may still be running the previous step's last W passes when this step's first
    activation reaches it, which a replay of the step alone would not know."""
    return [
        timeline.ready.get((replica, stage, step), -math.inf) for stage in range(timeline.stages)
    ]


def stepwise_theory(timeline: Timeline, replica: int = 0, *, hop_s: float | None = None) -> float:
    """The median over the measured steps of ``step_replay``'s bubble, with ``hop_s``
    per message (the run's ``message_time`` where not given): the theory
    ``measured_bubble`` (a median over the same steps) is compared with to judge the
    engine rather than the machine's noise."""
    return statistics.median(own for _, own in _own_replays(timeline, replica, hop_s))


def stepwise_ratios(
    timeline: Timeline, replica: int = 0, *, hop_s: float | None = None
) -> list[float]:
    """Each measured step's bubble over its own ``step_replay``'s, with ``hop_s`` per
    message (the run's ``message_time`` where not given); a step whose replay has no
    bubble is left out. What the engine idles beyond the schedule, judged step by step:
    a step paired with its own replay, not the median measured step with the median
    replay, which may be another step's (on a 2-stage mlp under ZB-H1, six launches
    gave paired medians of 1.067-1.077 and ratios of the two medians of 1.067-1.145,
    docs/benchmarks.md)."""
    return [
        bubble_of(*step_profile(timeline, step, replica)) / own
        for step, own in _own_replays(timeline, replica, hop_s)
        if own > 0
    ]


def _own_replays(
    timeline: Timeline, replica: int, hop_s: float | None
) -> Iterator[tuple[int, float]]:
    """Each measured step with its ``step_replay``'s bubble, ``hop_s`` per message (the
    run's ``message_time`` where None)."""
    hop = message_time(timeline, replica) if hop_s is None else hop_s
    for step in measured_steps(timeline, replica):
        yield step, step_replay(timeline, step, replica, hop_s=hop).bubble


@dataclass(frozen=True)
class PassGap:
    """How much later a pass started than it could have: after its stage's previous pass
    of the step ended and its inputs had come (each made on another device ``hop_s``
    after its pass ended). ``bound``: which came last, ``"stage"`` or ``"input"``."""

    stage: int
    chunk: int
    kind: str
    """The action's kind: ``"F"``, ``"B"`` or ``"W"``."""
    micro: int
    step: int
    bound: str
    seconds: float


def engine_gaps(
    timeline: Timeline, replica: int = 0, *, hop_s: float | None = None
) -> list[PassGap]:
    """Every measured pass's ``PassGap``, with ``hop_s`` per message (the run's
    ``message_time`` where not given): what the engine adds at each pass beyond what
    ``step_replay`` places (receiving and posting, its bookkeeping, a message slower than
    the hop). A stage's first pass of a step counts its stage free from when it began the
    step (``Timeline.ready``), and is left out where it has no input from another device:
    the stage's own setup before it is not the schedule's. A pass can
    start a little before its input's pass ended (the sender stamps its end after its
    send returns), so a gap can be slightly negative."""
    schedule = schedule_of(timeline)
    hop = message_time(timeline, replica) if hop_s is None else hop_s
    gaps = []
    for step in measured_steps(timeline, replica):
        rows = round_events(timeline, schedule, step, replica)
        began = _ready_times(timeline, step, replica)
        where = f"Step {step} of replica {replica}"
        for stage, previous, event, inputs in _passes_with_inputs(
            rows, timeline.virtual_stages, where
        ):
            arrivals = [sender.end + (hop if remote else 0.0) for sender, remote in inputs]
            if previous is None and not arrivals:
                continue
            free = previous.end if previous is not None else began[stage]
            ready = max(arrivals, default=-math.inf)
            gaps.append(
                PassGap(
                    stage=stage,
                    chunk=event.chunk,
                    kind=LETTER[event.kind],
                    micro=event.micro,
                    step=step,
                    bound="input" if ready > free else "stage",
                    seconds=event.start - max(free, ready),
                )
            )
    return gaps


def replayed_theory(timeline: Timeline, replica: int = 0) -> tuple[float, float]:
    """``(bubble, hop_s)``: the bubble this run's schedule must have on its own stage times
    and message time (``timeline_replay``), next to the textbook ``Timeline.theory``."""
    found = timeline_replay(timeline, replica)
    return found.bubble, found.hop_s
