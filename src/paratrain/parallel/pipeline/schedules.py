"""Pipeline schedules as pure per-stage action lists, and a clock simulator to check them.

A schedule says, for each stage, the order in which it runs forward (``F``) and backward
(``B``) passes of micro-batches. The engine follows the lists; this module proves them
sound without processes: ``simulate`` runs every stage in list order, each action as soon
as its inputs exist, and raises ``ScheduleDeadlock`` when some stage would wait forever.

Dependencies (virtual stage ``j`` = ``chunk * stages + stage``; plain schedules have one
chunk, so ``j`` is the stage): ``F(j, m)`` needs ``F(j - 1, m)``; ``B(j, m)`` needs
``B(j + 1, m)`` and ``F(j, m)``. Messages are assumed not to block the sender (buffered
or asynchronous sends) and to take no time, so the tables show compute only.

Backward passes run in increasing micro-batch order in every schedule here: activations
and gradients then cross each link in the order they were produced, so a per-link FIFO
queue (or a sequence of matching send/recv calls) delivers each message where it is
expected, with no tags or reordering.

Clock tables (``clock_table``) print one row per stage and one cell per tick: ``F3`` is
the forward of micro-batch 3, ``B3`` its backward, ``.`` an idle tick; an action lasting
several ticks fills that many cells. Interleaved schedules add the chunk as a letter
(``F3a`` chunk 0, ``F3b`` chunk 1). Cells are padded to one width, separated by a space,
and trailing spaces are dropped, e.g. GPipe with 2 stages and 2 micro-batches::

    F0 F1 .  .  B0 B1
    .  F0 F1 B0 B1 .
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "Timed",
    "build_schedule",
    "clock_table",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "simulate",
    "simulated_bubble",
]


class ScheduleError(ValueError):
    """A schedule that cannot be built or is malformed, said in one sentence."""


class ScheduleDeadlock(RuntimeError):
    """A schedule whose stages would wait for each other forever."""


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one stage (or one chunk of it)."""

    kind: str
    """``"F"`` (forward) or ``"B"`` (backward)."""
    micro: int
    """Micro-batch index."""
    chunk: int = 0
    """Virtual stage held by this device (interleaved schedules only)."""

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ScheduleError(f"action kind must be 'F' or 'B', not {self.kind!r}.")

    def label(self, *, chunks: int = 1) -> str:
        """``F3``, or ``F3b`` (chunk 1) when the schedule has several chunks."""
        suffix = string.ascii_lowercase[self.chunk] if chunks > 1 else ""
        return f"{self.kind}{self.micro}{suffix}"


Schedule = list[list[Action]]


def _check_counts(stages: int, micro_batches: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, not {value!r}.")


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (activations for all held)."""
    _check_counts(stages, micro_batches)
    forwards = [Action("F", m) for m in range(micro_batches)]
    backwards = [Action("B", m) for m in range(micro_batches)]
    return [forwards + backwards for _ in range(stages)]


def _one_f_one_b_order(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward while forwards remain, then
    the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """PipeDream-Flush (1F1B): stage ``s`` warms up with ``min(stages - s - 1, m)`` forwards.

    After the warm-up a stage alternates one forward and one backward, so it holds the
    activations of at most ``min(stages - s, m)`` micro-batches at once instead of GPipe's
    ``m``, at the same bubble.
    """
    _check_counts(stages, micro_batches)
    forwards = [Action("F", m) for m in range(micro_batches)]
    backwards = [Action("B", m) for m in range(micro_batches)]
    return [
        _one_f_one_b_order(forwards, backwards, min(stages - s - 1, micro_batches))
        for s in range(stages)
    ]


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each device holds ``chunks`` non-adjacent stages.

    Virtual stage ``c * stages + s`` lives on device ``s`` as chunk ``c``. Micro-batches
    go through in groups of ``stages``: a device runs the forwards of one group on chunk
    0, then on chunk 1, ..., then the next group; backwards mirror this from the last
    chunk. The warm-up is ``2 * (stages - s - 1) + (chunks - 1) * stages`` forwards
    (capped at all of them), then 1F1B. The bubble shrinks by a factor ``chunks``, at
    the cost of ``chunks`` times more messages.
    """
    _check_counts(stages, micro_batches)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"chunks must be a positive integer, not {chunks!r}.")
    if chunks > len(string.ascii_lowercase):
        raise ScheduleError(f"chunks must be at most {len(string.ascii_lowercase)}, not {chunks}.")
    if micro_batches % stages:
        raise ScheduleError(
            f"interleaved 1F1B runs micro-batches in groups of {stages} (one per stage), but "
            f"{micro_batches} is not a multiple of {stages}; use a multiple of {stages}."
        )
    total = micro_batches * chunks

    def action(kind: str, k: int) -> Action:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        if kind == "B":
            chunk = chunks - 1 - chunk
        return Action(kind, group * stages + within % stages, chunk)

    forwards = [action("F", k) for k in range(total)]
    backwards = [action("B", k) for k in range(total)]
    return [
        _one_f_one_b_order(
            forwards, backwards, min(2 * (stages - s - 1) + (chunks - 1) * stages, total)
        )
        for s in range(stages)
    ]


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The schedule function registered as ``name`` (``gpipe`` or ``1f1b``)."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}."
        )
    return SCHEDULES[name]


def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """The action lists of schedule ``name`` with ``chunks`` virtual stages per device:
    ``1f1b`` over several chunks is interleaved 1F1B; GPipe has no interleaved form here."""
    build = get_schedule(name)
    if chunks == 1:
        return build(stages, micro_batches)
    if build is not one_f_one_b:
        raise ScheduleError(
            f"virtual stages run the interleaved 1F1B schedule, not {name!r}; use "
            "schedule='1f1b' with virtual_stages > 1, or virtual_stages=1."
        )
    return interleaved_1f1b(stages, micro_batches, chunks)


@dataclass(frozen=True)
class Timed:
    """An action placed on the clock: it runs during ticks ``start .. end - 1``."""

    action: Action
    start: int
    end: int


def _chunk_count(schedule: Schedule) -> int:
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


def _check_schedule(schedule: Schedule) -> None:
    """Every stage must run each (micro-batch, chunk) forward and backward exactly once."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage.")
    expected: set[tuple[int, int]] | None = None
    for stage, actions in enumerate(schedule):
        for kind in ("F", "B"):
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


def simulate(
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 1
) -> list[list[Timed]]:
    """Place every action on an integer clock, each as early as its stage and inputs allow.

    Raises ``ScheduleDeadlock`` naming the stuck stages when no stage can make progress.
    """
    for name, value in (("forward_ticks", forward_ticks), ("backward_ticks", backward_ticks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, not {value!r}.")
    _check_schedule(schedule)
    stages = len(schedule)
    virtual = stages * _chunk_count(schedule)
    ticks = {"F": forward_ticks, "B": backward_ticks}
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro) -> end tick
    placed: list[list[Timed]] = [[] for _ in range(stages)]
    free = [0] * stages

    def needs(stage: int, action: Action) -> list[tuple[str, int, int]]:
        j = action.chunk * stages + stage
        if action.kind == "F":
            return [("F", j - 1, action.micro)] if j > 0 else []
        after = [("B", j + 1, action.micro)] if j < virtual - 1 else []
        return [*after, ("F", j, action.micro)]

    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(schedule):
            while len(placed[stage]) < len(actions):
                action = actions[len(placed[stage])]
                deps = needs(stage, action)
                if any(dep not in done for dep in deps):
                    break
                start = max([free[stage], *(done[dep] for dep in deps)])
                end = start + ticks[action.kind]
                placed[stage].append(Timed(action, start, end))
                done[(action.kind, action.chunk * stages + stage, action.micro)] = end
                free[stage] = end
                progress = True

    stuck = [
        f"stage {stage} at {actions[len(placed[stage])].label(chunks=virtual // stages)}"
        for stage, actions in enumerate(schedule)
        if len(placed[stage]) < len(actions)
    ]
    if stuck:
        raise ScheduleDeadlock(
            "the schedule cannot complete: "
            + ", ".join(stuck)
            + " wait for inputs that are scheduled only after them."
        )
    return placed


def clock_table(
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 1
) -> list[str]:
    """One row per stage, one cell per tick (see the module docstring for the format)."""
    placed = simulate(schedule, forward_ticks=forward_ticks, backward_ticks=backward_ticks)
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
    schedule: Schedule, *, forward_ticks: int = 1, backward_ticks: int = 2
) -> float:
    """Idle fraction of all stage-ticks until the last action ends.

    For GPipe and 1F1B this equals the textbook ``(p - 1) / (m + p - 1)``.
    """
    placed = simulate(schedule, forward_ticks=forward_ticks, backward_ticks=backward_ticks)
    makespan = max(slot.end for slots in placed for slot in slots)
    busy = sum(slot.end - slot.start for slots in placed for slot in slots)
    return (len(placed) * makespan - busy) / (len(placed) * makespan)


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches (per chunk) whose forward ran but backward not yet.

    This bounds the activations a stage holds at once: ``m`` for GPipe, ``min(p - s, m)``
    for 1F1B. Interleaved schedules count each (micro-batch, chunk) pair once.
    """
    peaks = []
    for actions in schedule:
        held = peak = 0
        for action in actions:
            held += 1 if action.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
