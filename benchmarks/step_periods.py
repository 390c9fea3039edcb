"""A pipeline run's steps taken back to back: each step's period and its busiest stage's
idle in it, measured and replayed.

The engine ends a step without a barrier unless clipping, the fp16 vote or a tie across
stages needs one, so one step's last passes on a later stage can run while the first
stage already runs the next step's (``PipelineEngine.flush``; ZB-H1's lists for that,
``schedules.zb_h1``). What a run of steps pays is then the period, from a step's first
pass on stage 0 (fed data, it starts each step) to the next step's; the busiest stage
waits for other stages the period less its passes' time and its own time between steps
(its optimizer step and the next step's setup: its own work, which every schedule pays
alike). A step measured alone, from its first pass to its last, overlaps its neighbours
there.

The theory replays the schedule's lists as steps back to back on the run's median pass
times and message time (``replay.timeline_replay``), each stage pausing between steps for
its median measured pause (from its last pass of a step to when it began the next,
``Timeline.ready``): ``schedule_clock.steady_step``.
"""

from __future__ import annotations

import statistics

from paratrain.parallel.pipeline.replay import TimelineReplay, round_events, schedule_of
from paratrain.parallel.pipeline.schedule_clock import steady_step
from paratrain.parallel.pipeline.schedules import Action
from paratrain.parallel.pipeline.timeline import StageEvent, Timeline


def steady_periods(timeline: Timeline, steps_per_round: int) -> list[tuple[int, int]]:
    """Pairs of steps ``(k, k + 1)`` run right after each other and after step ``k - 1``:
    the bench runs ``steps_per_round`` steps in a row, then torch's
    (``alternation.median_step_times``), from the timeline's first step on. A round's
    first step follows a barrier, not a step, so its period starts with the pipeline
    empty (every stage waits for the first forward), which a run of steps pays once: it
    is left out."""
    steps = set(timeline.steps())
    first = min(steps)
    return [
        (step, step + 1)
        for step in sorted(steps)
        if step + 1 in steps and 0 < (step - first) % steps_per_round < steps_per_round - 1
    ]


def _rows_by_step(timeline: Timeline) -> dict[int, list[list[StageEvent]]]:
    """Each step's passes per stage in start order (``replay.round_events``), read once."""
    lists = schedule_of(timeline)
    return {step: round_events(timeline, lists, step, 0) for step in timeline.steps()}


def period_idles(timeline: Timeline, steps_per_round: int) -> list[float]:
    """Each steady period's waiting on the busiest stage (the one with the most work in
    the period's step): the period less the time that stage computed within it,
    whichever step its passes belonged to (a later stage runs the last step's W passes
    in it), and less its own time between two steps within it (from its last pass of a
    step to when it began the next: its optimizer step and the next step's setup, work
    of its own that every schedule pays alike, not a wait for another stage)."""
    idles = []
    rows_of = _rows_by_step(timeline)
    for step, after in steady_periods(timeline, steps_per_round):
        rows = rows_of[step]
        start, end = rows[0][0].start, rows_of[after][0][0].start
        busiest = max(range(len(rows)), key=lambda s: sum(e.duration for e in rows[s]))
        spans = [
            (e.start, e.end)
            for e in timeline.events
            if e.replica == 0 and e.stage == busiest and step - 1 <= e.step <= after
        ]
        for before, following in ((step - 1, step), (step, after)):
            began = timeline.ready.get((0, busiest, following))
            if began is not None and before in rows_of:
                spans.append((rows_of[before][busiest][-1].end, began))
        taken = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
        idles.append(end - start - taken)
    return idles


def stage_pauses(timeline: Timeline, steps_per_round: int) -> list[float]:
    """Each stage's median seconds from its last pass of a step to when it began the next
    (its optimizer step and the next step's setup); 0 where the timeline has no record of
    when stages began steps."""
    seen: list[list[float]] = [[] for _ in range(timeline.stages)]
    rows_of = _rows_by_step(timeline)
    for step, after in steady_periods(timeline, steps_per_round):
        for stage, row in enumerate(rows_of[step]):
            began = timeline.ready.get((0, stage, after))
            if began is not None:
                seen[stage].append(began - row[-1].end)
    return [max(statistics.median(pauses), 0.0) if pauses else 0.0 for pauses in seen]


def replayed_period_idle(
    timeline: Timeline, replayed: TimelineReplay, pauses: list[float]
) -> float:
    """The busiest stage's waiting per period (``period_idles``) of the run's lists
    placed as steps back to back on its median passes (``replayed``) with ``pauses``
    between steps (``steady_step``'s ``waiting``)."""
    lists = schedule_of(timeline)
    durations = replayed.durations

    def length(stage: int, action: Action) -> float:
        return durations[stage, action.chunk, action.kind]

    steady = steady_step(
        lists, length, hop=replayed.hop_s, between=lambda stage: pauses[stage], steps=6
    )
    return steady.waiting
