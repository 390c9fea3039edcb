"""Pipeline schedules as pure per-stage action lists.

A schedule says, for each stage, the order in which it runs forward (``F``) and backward
(``B``) passes of micro-batches. A zero-bubble schedule splits the backward in two: ``B``
then computes only the gradient of the stage's input (what the previous stage waits for)
and ``W`` the gradients of the weights (which nobody waits for), so W passes can fill
the ticks a stage would otherwise idle. The first stage of a split schedule is fed data:
it has no input gradient to make, so the engine runs its B as nothing and its W as its
whole backward (``split_backward.LayerTape``), and the clock runs it so too
(``stage_ticks``). The engine follows the lists (``runner``); ``schedule_clock`` proves
them sound without processes and places them in time. What a stage holds is read off its
own list (``max_in_flight``, ``chunk_occupancy``, ``split_occupancy``).

Backward passes run in increasing micro-batch order in every schedule here: activations
and gradients then cross each link in the order they were produced, so a per-link FIFO
queue (or a sequence of matching send/recv calls) delivers each message where it is
expected, with no tags or reordering.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from functools import cache, partial

from paratrain.parallel.pipeline.actions import (
    Action,
    Schedule,
    ScheduleError,
    splits_backward,
    stage_ticks,
)
from paratrain.parallel.pipeline.schedule_clock import steady_step

__all__ = [
    "SCHEDULES",
    "SPLIT_SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "chunk_occupancy",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "split_occupancy",
    "splits_backward",
    "stage_ticks",
    "zb_h1",
    "zb_h2",
]


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


def zb_h1(stages: int, micro_batches: int, *, flush: bool = True) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with its backward
    split into B and W, the W passes deferred to fill 1F1B's bubble.

    Built by playing the pipeline on a clock where F, B and W each take one tick, but on
    the first stage, which the engine runs with an empty B and its whole backward as W
    (``stage_ticks``, ``_played``). A free stage runs, in this order of preference: a W if
    ``stages`` are pending (B done, W not); its next B if the output gradient has arrived;
    its next F if fewer than ``stages - s`` micro-batches are between F and B (1F1B's
    bound); any pending W; else it idles. The lists are then plain data
    (``schedule_clock.simulate`` replays them). With F = B = W the bubble is
    ``(p - 1) / (3m + p - 1)``, the paper's ``(p - 1)(T_F + T_B - T_W)`` per stage, against
    1F1B's ``(p - 1) / (m + p - 1)`` (for m >= p). Memory: 1F1B's ``p - s`` micro-batches
    between F and B, plus at most ``p`` whose W is pending, ``2p - 1 - s`` from F to W
    (``max_in_flight``), fewer on the first stage from p = 4 (its W follows its empty B
    sooner: 6 of 7 at p = 4, 12 of 15 at 8).

    The first stage's bound is its memory instead: its B is empty and frees nothing, so
    1F1B's count between F and B bounds no activations there (they are held from F to W),
    and it made that stage wait for the first output gradient before its next forward
    while it held fewer than it holds later. There the next F runs while fewer
    micro-batches hold activations than the rule above holds at that stage's peak
    (``first_stage_hold``): the same peak, no B or W of any stage holding more than one of
    the rule's own lists (``split_occupancy``), and the same bubble on the unit clock
    (``tests/test_schedules.py``). Where the first stage carries more work than the next
    it no longer idles before its first B: the bench's mlp-first-loaded, whose list
    replayed on its stage times idled that stage 0.33 of 1F1B's idle, now 0; on random
    stage times the lists never take longer (the same test).

    ``flush=False`` gives the lists for steps that no barrier ends (no clipping, fp16
    vote or tie across stages: ``PipelineEngine.flush``), run back to back: a later stage
    keeps W passes for its step's end, run while the first stage starts the next step
    (``_steps_back_to_back``; ``tests/test_steps_back_to_back.py``). Each call returns
    fresh lists (the lists are worked out once per size and kept).
    """
    return [list(actions) for actions in _zb_h1_lists(stages, micro_batches, flush)]


@cache
def _zb_h1_lists(stages: int, micro_batches: int, flush: bool) -> tuple[tuple[Action, ...], ...]:
    """``zb_h1``'s lists, kept: without a flush they are chosen by placing runs of steps."""
    hold = max_in_flight(_played(stages, micro_batches, _zb_h1_choice))[0]
    flushed = _played(stages, micro_batches, partial(_zb_h1_choice, first_stage_hold=hold))
    chosen = flushed if flush else _steps_back_to_back(stages, micro_batches, hold, flushed)
    return tuple(tuple(actions) for actions in chosen)


def _steps_back_to_back(stages: int, micro_batches: int, hold: int, flushed: Schedule) -> Schedule:
    """ZB-H1's lists for steps that follow each other with no barrier: a stage after the
    first keeps more W passes pending (``_zb_h1_choice``'s ``tail_hold``), so that it
    still has W to run after its last B, while the first stage ends the step and starts
    the next one. Each cap from 1F1B's (the flushed lists) up is played, and the one whose
    steps, placed back to back on the unit clock (``schedule_clock.steady_step``), idle
    the least per step is kept, the lowest cap among equals; none may make any stage hold
    more micro-batches than the flushed lists' most (``max_in_flight``), so the flushed
    lists are kept where no cap does better."""
    ticks = [stage_ticks(s, 1, 2, 1, split=True) for s in range(stages)]

    def idle(lists: Schedule) -> float:
        return steady_step(lists, lambda s, action: ticks[s][action.kind]).busiest_idle

    most = max(max_in_flight(flushed))
    best, least = flushed, idle(flushed)
    for tail in range(stages, 2 * stages + 2):
        lists = _played(
            stages, micro_batches, partial(_zb_h1_choice, first_stage_hold=hold, tail_hold=tail)
        )
        if max(max_in_flight(lists)) <= most and (spent := idle(lists)) < least:
            best, least = lists, spent
    return best


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
    ``schedule_clock.simulate``'s ``weight_ticks``) ZB-H1's W passes no longer cover the
    wait for the first output gradient, and ZB-H2's extra forwards do
    (``schedule_clock.simulated_bubble``).
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


def _zb_h1_choice(
    s: int,
    stages: int,
    micro_batches: int,
    count: dict[str, int],
    ready,
    first_stage_hold: int | None = None,
    tail_hold: int | None = None,
):
    """The kind stage ``s`` runs now under ZB-H1's rule (see ``zb_h1``); with
    ``first_stage_hold``, the first stage's next F waits only on that many holding
    activations (F done, W not) instead of on 1F1B's bound between F and B; with
    ``tail_hold``, a stage after the first runs a W before anything else only once more
    than ``tail_hold - (stages - s)`` are pending (at least 1F1B's ``stages - 1``), so it
    keeps that many for its step's end (``_steps_back_to_back``)."""
    pending = count["B"] - count["W"]
    deferred = stages - 1
    if s and tail_hold is not None:
        deferred = max(deferred, tail_hold - (stages - s))
    if pending > deferred:
        return "W"
    if _next_b_ready(s, stages, micro_batches, count, ready):
        return "B"
    if s == 0 and first_stage_hold is not None:
        room = count["F"] - count["W"] < first_stage_hold
    else:
        room = count["F"] - count["B"] < stages - s
    if _next_f_ready(s, micro_batches, count, ready) and room:
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


def build_schedule(
    name: str, stages: int, micro_batches: int, chunks: int = 1, *, flush: bool = True
) -> Schedule:
    """The action lists of schedule ``name`` with ``chunks`` virtual stages per device:
    ``1f1b`` over several chunks is interleaved 1F1B; GPipe has no interleaved form here.
    ``flush``: whether every stage waits for every other at a step's end (clipping, the
    fp16 vote, a tie across stages); without one ZB-H1 runs its lists for steps back to
    back (``zb_h1``), every other schedule the same lists."""
    build = get_schedule(name)
    if chunks == 1:
        if build is zb_h1:
            return zb_h1(stages, micro_batches, flush=flush)
        return build(stages, micro_batches)
    if build is not one_f_one_b:
        raise ScheduleError(
            f"virtual stages run the interleaved 1F1B schedule, not {name!r}; use "
            "schedule='1f1b' with virtual_stages > 1, or virtual_stages=1."
        )
    return interleaved_1f1b(stages, micro_batches, chunks)


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
