"""The clock that proves pipeline schedules sound, and places them in time.

``simulate`` runs every stage's action list (``schedules``) in its order, each action as
soon as its inputs exist, on an integer clock, and raises ``ScheduleDeadlock`` when some
stage would wait forever; ``place_actions`` is the same placement for any lengths, which
``replay`` gives in measured seconds with a message time (``hop``).

Dependencies (virtual stage ``j`` = ``chunk * stages + stage``; plain schedules have one
chunk, so ``j`` is the stage): ``F(j, m)`` needs ``F(j - 1, m)``; ``B(j, m)`` needs
``B(j + 1, m)`` and ``F(j, m)``; ``W(j, m)`` needs ``B(j, m)``. Messages are assumed not
to block the sender (buffered or asynchronous sends) and to take no time, so the tables
show compute only.

Clock tables (``clock_table``) print one row per stage and one cell per tick: ``F3`` is
the forward of micro-batch 3, ``B3`` its backward, ``.`` an idle tick; an action lasting
several ticks fills that many cells. Interleaved schedules add the chunk as a letter
(``F3a`` chunk 0, ``F3b`` chunk 1). Cells are padded to one width, separated by a space,
and trailing spaces are dropped, e.g. GPipe with 2 stages and 2 micro-batches::

    F0 F1 .  .  B0 B1
    .  F0 F1 B0 B1 .
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paratrain.parallel.pipeline.actions import (
    Action,
    Schedule,
    ScheduleError,
    splits_backward,
    stage_ticks,
)


class ScheduleDeadlock(RuntimeError):
    """A schedule whose stages would wait for each other forever."""


@dataclass(frozen=True)
class Timed:
    """An action placed on the clock: it runs during ticks ``start .. end - 1``."""

    action: Action
    start: int
    end: int


def _chunk_count(schedule: Schedule) -> int:
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


def _check_schedule(schedule: Schedule) -> None:
    """Every stage must run each (micro-batch, chunk) forward and backward (and, where the
    backward is split, weight pass) exactly once."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage.")
    expected: set[tuple[int, int]] | None = None
    kinds = ("F", "B", "W") if splits_backward(schedule) else ("F", "B")
    for stage, actions in enumerate(schedule):
        for kind in kinds:
            keys = [(a.micro, a.chunk) for a in actions if a.kind == kind]
            if len(set(keys)) != len(keys):
                raise ScheduleError(f"stage {stage} runs some {kind} action twice.")
            if expected is None:
                expected = set(keys)
            elif set(keys) != expected:
                raise ScheduleError(
                    f"stage {stage} runs {kind} for micro-batches/chunks {sorted(keys)}, "
                    f"but the schedule needs exactly {sorted(expected)}."
                )


def _action_ticks(schedule: Schedule, forward: int, backward: int, weight: int) -> dict:
    """Ticks per kind (checked), to be shared out per stage by ``stage_ticks``."""
    for name, value in (("forward_ticks", forward), ("backward_ticks", backward)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, not {value!r}.")
    if not splits_backward(schedule):
        return {"forward": forward, "backward": backward, "weight": 0}
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight < backward:
        raise ScheduleError(
            f"a split backward needs 1 <= weight_ticks < backward_ticks ({backward}), not "
            f"{weight!r}; give backward_ticks of at least 2."
        )
    return {"forward": forward, "backward": backward, "weight": weight}


def simulate(
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 1, weight_ticks: int = 1
) -> list[list[Timed]]:
    """Place every action on an integer clock, each as early as its stage and inputs allow.

    ``backward_ticks`` is the whole backward; a schedule that splits it runs B for
    ``backward_ticks - weight_ticks`` and W for ``weight_ticks`` (on its first stage B
    for none and W for all of it: ``stage_ticks``), so that schedules with and without
    the split compare on one clock. Raises ``ScheduleDeadlock`` naming the
    stuck stages when no stage can make progress.
    """
    given = _action_ticks(schedule, forward_ticks, backward_ticks, weight_ticks)
    split = splits_backward(schedule)
    ticks = [stage_ticks(s, **given, split=split) for s in range(len(schedule))]
    placed = place_actions(schedule, lambda stage, action: ticks[stage][action.kind], hop=0)
    return [[Timed(action, start, end) for action, start, end in slots] for slots in placed]


Dependency = tuple[str, int, int]
"""``(kind, virtual stage, micro-batch)`` of a pass another pass waits for."""


def dependencies(stage: int, action: Action, stages: int, virtual: int) -> list[Dependency]:
    """What ``action`` on ``stage`` waits for (see the module docstring), among
    ``virtual`` virtual stages over ``stages`` devices."""
    j = action.chunk * stages + stage
    if action.kind == "F":
        return [("F", j - 1, action.micro)] if j > 0 else []
    if action.kind == "W":
        return [("B", j, action.micro)]
    after = [("B", j + 1, action.micro)] if j < virtual - 1 else []
    return [*after, ("F", j, action.micro)]


def place_actions(
    schedule: Schedule,
    length: Callable[[int, Action], float],
    *,
    hop: float,
    pause: Callable[[int, int], float] | None = None,
    release: Sequence[float] | None = None,
) -> list[list[tuple[Action, float, float]]]:
    """Every action as ``(action, start, end)``, each as early as its stage and inputs
    allow: ``length(stage, action)`` long, and ``hop`` after an input made on another
    device (virtual stage ``j`` sits on device ``j % stages``). ``pause(stage, i)``: the
    seconds the stage spends on its own after its ``i``-th action before it can start the
    next (the optimizer step between two steps run back to back, ``steady_step``);
    ``release[stage]``: when the stage is free to start (0 where not given; a step that
    reached a stage still busy with the last one, ``replay.step_replay``).
    Integer lengths and hop give integer times (``simulate``'s clock); ``replay`` gives
    seconds. Raises ``ScheduleDeadlock`` naming the stuck stages when no stage can make
    progress, and ``ScheduleError`` on lists that do not run every pass exactly once."""
    _check_schedule(schedule)
    stages = len(schedule)
    virtual = stages * _chunk_count(schedule)
    done: dict[Dependency, float] = {}  # (kind, virtual stage, micro) -> end
    placed: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    free: list[float] = list(release) if release is not None else [0] * stages
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(schedule):
            while len(placed[stage]) < len(actions):
                action = actions[len(placed[stage])]
                deps = dependencies(stage, action, stages, virtual)
                if any(dep not in done for dep in deps):
                    break
                arrivals = [done[dep] + (hop if dep[1] % stages != stage else 0) for dep in deps]
                start = max([free[stage], *arrivals])
                end = start + length(stage, action)
                placed[stage].append((action, start, end))
                done[(action.kind, action.chunk * stages + stage, action.micro)] = end
                free[stage] = end + (pause(stage, len(placed[stage]) - 1) if pause else 0)
                progress = True
    _raise_if_stuck(schedule, placed, virtual // stages)
    return placed


def back_to_back(schedule: Schedule, steps: int) -> Schedule:
    """The lists of ``steps`` training steps run one after another: each stage runs its
    list ``steps`` times, run ``k``'s micro-batches numbered from ``k * m``. Nothing but
    each stage's own order joins two steps, as in the engine, where no collective ends a
    step unless clipping, the fp16 vote or a tie across stages needs one (``flush``):
    a stage may still be running one step's passes when the next step's first
    activation reaches it."""
    micro_batches = 1 + max(a.micro for actions in schedule for a in actions)
    return [
        [Action(a.kind, a.micro + k * micro_batches, a.chunk) for k in range(steps) for a in row]
        for row in schedule
    ]


@dataclass(frozen=True)
class SteadyStep:
    """A step of a run of steps placed back to back, once the run has settled."""

    period: float
    """From one step's first pass on the first stage to the next step's."""
    busiest_idle: float
    """The period less the busy time of the stage that works most in a step."""
    waiting: float
    """``busiest_idle`` less that stage's own time between steps (``between``: its
    optimizer step): the time it waits for other stages, the bubble a run of steps pays
    on the stage that bounds it."""


def steady_step(
    schedule: Schedule,
    length: Callable[[int, Action], float],
    *,
    hop: float = 0.0,
    between: Callable[[int], float] | None = None,
    steps: int = 4,
) -> SteadyStep:
    """``steps`` steps of ``schedule`` placed back to back (``back_to_back``), each
    stage spending ``between(stage)`` after its last pass of a step (its optimizer step;
    none where not given): the last period, from the last step but one's first pass on
    stage 0 to the last step's. Stage 0 is fed data, so each step starts there."""
    if steps < 2:
        raise ScheduleError(f"a period needs at least 2 steps, not {steps}.")
    per_step = len(schedule[0])

    def pause(stage: int, position: int) -> float:
        ends_step = (position + 1) % len(schedule[stage]) == 0
        return between(stage) if between is not None and ends_step else 0.0

    chained = back_to_back(schedule, steps)
    placed = place_actions(chained, length, hop=hop, pause=pause)
    starts = [placed[0][k * per_step][1] for k in (steps - 2, steps - 1)]
    period = starts[1] - starts[0]
    busy = [
        sum(end - start for _, start, end in row[: len(actions)])
        for row, actions in zip(placed, schedule, strict=True)
    ]
    busiest = busy.index(max(busy))
    own = between(busiest) if between is not None else 0.0
    idle = period - busy[busiest]
    return SteadyStep(period=period, busiest_idle=idle, waiting=idle - own)


def _raise_if_stuck(schedule: Schedule, placed: list[list], chunks: int) -> None:
    stuck = [
        f"stage {stage} at {actions[len(placed[stage])].label(chunks=chunks)}"
        for stage, actions in enumerate(schedule)
        if len(placed[stage]) < len(actions)
    ]
    if stuck:
        raise ScheduleDeadlock(
            "the schedule cannot complete: "
            + ", ".join(stuck)
            + " wait for inputs that are scheduled only after them."
        )


def clock_table(
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 1, weight_ticks: int = 1
) -> list[str]:
    """One row per stage, one cell per tick (see the module docstring for the format)."""
    placed = simulate(
        schedule,
        forward_ticks=forward_ticks,
        backward_ticks=backward_ticks,
        weight_ticks=weight_ticks,
    )
    chunks = _chunk_count(schedule)
    makespan = max(slot.end for slots in placed for slot in slots)
    rows: list[list[str]] = []
    for slots in placed:
        cells = ["."] * makespan
        for slot in slots:
            cells[slot.start : slot.end] = [slot.action.label(chunks=chunks)] * (
                slot.end - slot.start
            )
        rows.append(cells)
    width = max(len(cell) for cells in rows for cell in cells)
    return [" ".join(cell.ljust(width) for cell in cells).rstrip() for cells in rows]


def simulated_bubble(
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 2, weight_ticks: int = 1
) -> float:
    """Idle fraction of all stage-ticks until the last action ends.

    For GPipe and 1F1B this equals the textbook ``(p - 1) / (m + p - 1)``.
    """
    placed = simulate(
        schedule,
        forward_ticks=forward_ticks,
        backward_ticks=backward_ticks,
        weight_ticks=weight_ticks,
    )
    makespan = max(slot.end for slots in placed for slot in slots)
    busy = sum(slot.end - slot.start for slots in placed for slot in slots)
    return (len(placed) * makespan - busy) / (len(placed) * makespan)


def timed_bubble(schedule: Schedule, times: dict[str, float], resolution: int = 20) -> float:
    """``simulated_bubble`` with the mean seconds of a forward, an input-gradient B and a
    weight W (``times``: ``forward``, ``backward``, ``weight``), as whole ticks, the
    longest ``resolution`` ticks (at least one each); the idle time per stage is this
    fraction of the makespan."""
    t = [times["forward"], times["backward"], times["weight"]]
    longest = max(t) if max(t) > 0 else 1.0
    f, b, w = (max(1, round(resolution * x / longest)) for x in t)
    return simulated_bubble(schedule, forward_ticks=f, backward_ticks=b + w, weight_ticks=w)
