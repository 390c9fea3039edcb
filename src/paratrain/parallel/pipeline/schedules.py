"""Pipeline schedules as pure per-stage action lists, and a clock simulator to check them.

A schedule says, for each stage, the order in which it runs forward (``F``) and backward
(``B``) passes of micro-batches. A zero-bubble schedule splits the backward in two: ``B``
then computes only the gradient of the stage's input (what the previous stage waits for)
and ``W`` the gradients of the weights (which nobody waits for), so W passes can fill
the ticks a stage would otherwise idle. The first stage of a split schedule is fed data:
it has no input gradient to make, so the engine runs its B as nothing and its W as its
whole backward (``split_backward.LayerTape``), and the clock here runs it so too
(``stage_ticks``). The engine follows the lists; this module proves them
sound without processes: ``simulate`` runs every stage in list order, each action as soon
as its inputs exist, and raises ``ScheduleDeadlock`` when some stage would wait forever.

Dependencies (virtual stage ``j`` = ``chunk * stages + stage``; plain schedules have one
chunk, so ``j`` is the stage): ``F(j, m)`` needs ``F(j - 1, m)``; ``B(j, m)`` needs
``B(j + 1, m)`` and ``F(j, m)``; ``W(j, m)`` needs ``B(j, m)``. Messages are assumed not
to block the sender (buffered or asynchronous sends) and to take no time, so the tables
show compute only (``replay`` places the same lists with measured seconds and a message
time, through the same ``place_actions``).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "SPLIT_SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "Timed",
    "build_schedule",
    "chunk_occupancy",
    "clock_table",
    "dependencies",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "place_actions",
    "simulate",
    "simulated_bubble",
    "split_occupancy",
    "splits_backward",
    "stage_ticks",
    "timed_bubble",
    "zb_h1",
    "zb_h2",
]


class ScheduleError(ValueError):
    """A schedule that cannot be built or is malformed, said in one sentence."""


class ScheduleDeadlock(RuntimeError):
    """A schedule whose stages would wait for each other forever."""


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


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with its backward
    split into B and W, the W passes deferred to fill 1F1B's bubble.

    Built by playing the pipeline on a clock where F, B and W each take one tick, but on
    the first stage, which the engine runs with an empty B and its whole backward as W
    (``stage_ticks``, ``_played``). A free stage runs, in this order of preference: a W if
    ``stages`` are pending (B done, W not); its next B if the output gradient has arrived;
    its next F if fewer than ``stages - s`` micro-batches are between F and B (1F1B's
    bound); any pending W; else it idles. The lists are then plain data (``simulate``
    replays them). With F = B = W the bubble is ``(p - 1) / (3m + p - 1)``, the paper's
    ``(p - 1)(T_F + T_B - T_W)`` per stage, against 1F1B's ``(p - 1) / (m + p - 1)`` (for
    m >= p). Memory: 1F1B's ``p - s`` micro-batches between F and B, plus at most ``p``
    whose W is pending, ``2p - 1 - s`` from F to W (``max_in_flight``), fewer on the first
    stage from p = 4 (its W follows its empty B sooner: 6 of 7 at p = 4, 12 of 15 at 8).
    """
    return _played(stages, micro_batches, _zb_h1_choice)


def zb_h2(stages: int, micro_batches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2023): ZB-H1 with more warm-up forwards, so that W fills the
    bubble before the first B as well as after it.

    Played on the same clock as ``zb_h1``. A free stage runs, in this order of preference:
    a pending W if ``2p - 1`` micro-batches hold activations (F done, W not: the memory
    cap); its next B if the output gradient has arrived; its next F if fewer than
    ``2(p - s) - 1`` micro-batches are between F and B (as many as fit before the first
    output gradient can arrive) and fewer than ``2p - 1`` hold activations; any pending
    W; else it idles. Memory: up to ``min(2p - 1, m)`` micro-batches on every stage,
    against ZB-H1's ``2p - 1 - s``. The step still ends with every stage's optimizer step
    (a flush), so the idle ticks before a stage's first F and after its last W remain:
    with F = B = W the bubble equals ZB-H1's, ``(p - 1) / (3m + p - 1)``, the least any
    schedule with a flush has on that clock; where B takes longer than W (as measured by
    ``simulate``'s ``weight_ticks``) ZB-H1's W passes no longer cover the wait for the
    first output gradient, and ZB-H2's extra forwards do (``simulated_bubble``).
    """
    return _played(stages, micro_batches, _zb_h2_choice)


Choice = Callable[
    [int, int, int, dict[str, int], Callable[[tuple[str, int, int]], bool]], str | None
]
"""A zero-bubble rule: (stage, stages, micro-batches, the stage's counts of F, B and W
run so far, whether an action has ended by now) -> the kind the stage runs now, or None."""


def _played(
    stages: int, micro_batches: int, choice: Choice, clock: list[dict] | None = None
) -> Schedule:
    """The action lists of a rule played on a clock where F, B and W each take one tick,
    but on the first stage, whose B is empty and whose W is its whole backward
    (``stage_ticks``); every kind runs in micro-batch order on each stage.

    Why the first stage's own clock: played with B = W = 1 there, the rule defers that
    stage's W passes as it defers every stage's, to free its B sooner for a previous stage
    it does not have; its W passes, each a whole backward, then pile up after the last
    gradient arrives, and with F = B = W elsewhere ZB-H1 idled two thirds of 1F1B's
    bubble instead of the paper's third (at any p; m >= 2p). ``clock``: ticks per kind on
    each stage, to play another (a test plays B = W = 1 everywhere)."""
    _check_counts(stages, micro_batches)
    order: list[list[Action]] = [[] for _ in range(stages)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> end tick
    counts = [{"F": 0, "B": 0, "W": 0} for _ in range(stages)]
    ticks = clock or [stage_ticks(s, 1, 2, 1, split=True) for s in range(stages)]
    free = [0] * stages
    tick, total = 0, 3 * micro_batches * stages
    while len(done) < total:

        def ready(key: tuple[str, int, int], now: int = tick) -> bool:
            return done.get(key, now + 1) <= now

        for s in range(stages):  # a pass of no ticks leaves its stage free this tick
            while free[s] <= tick and (kind := choice(s, stages, micro_batches, counts[s], ready)):
                micro = counts[s][kind]
                order[s].append(Action(kind, micro))
                counts[s][kind] += 1
                free[s] = done[kind, s, micro] = tick + ticks[s][kind]
        tick += 1
    return order


def _next_b_ready(s: int, stages: int, micro_batches: int, count: dict[str, int], ready) -> bool:
    """Whether stage ``s`` can run its next B: its F ran and the output gradient arrived."""
    b = count["B"]
    if b >= micro_batches or not ready(("F", s, b)):
        return False
    return s == stages - 1 or ready(("B", s + 1, b))


def _next_f_ready(s: int, micro_batches: int, count: dict[str, int], ready) -> bool:
    """Whether stage ``s`` can run its next F: one remains and its input arrived."""
    f = count["F"]
    return f < micro_batches and (s == 0 or ready(("F", s - 1, f)))


def _zb_h1_choice(s: int, stages: int, micro_batches: int, count: dict[str, int], ready):
    """The kind stage ``s`` runs now under ZB-H1's rule (see ``zb_h1``)."""
    pending = count["B"] - count["W"]
    if pending > stages - 1:
        return "W"
    if _next_b_ready(s, stages, micro_batches, count, ready):
        return "B"
    if _next_f_ready(s, micro_batches, count, ready) and count["F"] - count["B"] < stages - s:
        return "F"
    return "W" if pending else None


def _zb_h2_choice(s: int, stages: int, micro_batches: int, count: dict[str, int], ready):
    """The kind stage ``s`` runs now under ZB-H2's rule (see ``zb_h2``)."""
    pending, cap = count["B"] - count["W"], 2 * stages - 1
    holding = count["F"] - count["W"]
    if pending and holding >= cap:
        return "W"
    if _next_b_ready(s, stages, micro_batches, count, ready):
        return "B"
    warm = count["F"] - count["B"] < 2 * (stages - s) - 1
    if _next_f_ready(s, micro_batches, count, ready) and warm and holding < cap:
        return "F"
    return "W" if pending else None


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits its backward into B (input) and W (weights)."""
    return any(a.kind == "W" for actions in schedule for a in actions)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}
SPLIT_SCHEDULES = ("zb-h1", "zb-h2")
"""The registered schedules that split the backward into B and W."""


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The schedule function registered as ``name`` (one of ``SCHEDULES``)."""
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
    schedule: Schedule, length: Callable[[int, Action], float], *, hop: float
) -> list[list[tuple[Action, float, float]]]:
    """Every action as ``(action, start, end)``, each as early as its stage and inputs
    allow: ``length(stage, action)`` long, and ``hop`` after an input made on another
    device (virtual stage ``j`` sits on device ``j % stages``). Integer lengths and hop
    give integer times (``simulate``'s clock); ``replay`` gives seconds. Raises
    ``ScheduleDeadlock`` naming the stuck stages when no stage can make progress, and
    ``ScheduleError`` on lists that do not run every pass exactly once."""
    _check_schedule(schedule)
    stages = len(schedule)
    virtual = stages * _chunk_count(schedule)
    done: dict[Dependency, float] = {}  # (kind, virtual stage, micro) -> end
    placed: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    free: list[float] = [0] * stages
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
                free[stage] = end
                progress = True
    _raise_if_stuck(schedule, placed, virtual // stages)
    return placed


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


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches (per chunk) whose forward ran but backward (its W,
    where the backward is split: W still needs the activations) not yet.

    This bounds the activations a stage holds at once: ``m`` for GPipe, ``min(p - s, m)``
    for 1F1B and ZB-H1. Interleaved schedules count each (micro-batch, chunk) pair once.
    """
    frees = "W" if splits_backward(schedule) else "B"
    peaks = []
    for actions in schedule:
        pairs = [1.0] * (1 + max((a.chunk for a in actions), default=0))  # each pair 1
        peaks.append(int(chunk_occupancy(actions, pairs, frees)[0]))
    return peaks


def chunk_occupancy(
    actions: list[Action], saved: Sequence[float], frees: str
) -> tuple[float, list[tuple[float, int]]]:
    """One stage's activations read off its actions, ``saved[c]`` per micro-batch of chunk
    c from its forward to the action that ``frees`` them (B, or W where the backward is
    split): the most held at once, and at each freeing action the amount held then (its
    own pair included) and its chunk (``pipeline/chunk_cost``)."""
    held = peak = 0.0
    freed = []
    for action in actions:
        if action.kind == "F":
            held += saved[action.chunk]
            peak = max(peak, held)
        elif action.kind == frees:
            freed.append((held, action.chunk))
            held -= saved[action.chunk]
    return peak, freed


def split_occupancy(actions: list[Action]) -> list[tuple[str, int, int]]:
    """One stage's split backward, read off its actions: at each B and W, how many
    micro-batches hold their activations (forward run, W not yet; this one included) and
    how many hold the output gradients B keeps for W (B run, W not yet; this one included
    at its W, not at its B, which is still making them). The peaks of a split backward
    are at these actions (``pipeline/cost.split_moments``)."""
    held = kept = 0
    found = []
    for action in actions:
        if action.kind == "F":
            held += 1
        elif action.kind == "B":
            found.append(("B", held, kept))
            kept += 1
        else:
            found.append(("W", held, kept))
            held, kept = held - 1, kept - 1
    return found
