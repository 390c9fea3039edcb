"""The schedule replayed on measured times (``pipeline/replay.py``): the simulator's clock
when times are equal and messages free, a hand-worked unequal case with a message time,
and a synthetic timeline whose pass times and message time the replay must recover.

Tolerances: the clock cases use whole and half units, exact in binary, so only the final
divisions round (a few float64 roundings, ~1e-16 relative): ``rel=1e-12``. The timeline
case stamps ``step + seconds``, rounded to float64 near 2 (2^-51 ~ 4.4e-16 s each), and
sums a few dozen such stamps: durations and the message time carry ~1e-14 s at most, hence
``abs=1e-12`` s; a bubble divides ~1e-14 s by a span of ~0.05 s, hence ``abs=1e-10``.
"""

from __future__ import annotations

import json

import pytest

from paratrain.parallel.pipeline.replay import (
    Slot,
    engine_gaps,
    message_time,
    replay,
    replayed_bubble,
    replayed_theory,
    stage_durations,
    step_replay,
    stepwise_ratios,
    stepwise_theory,
    timeline_replay,
)
from paratrain.parallel.pipeline.schedule_clock import (
    ScheduleDeadlock,
    place_actions,
    simulated_bubble,
)
from paratrain.parallel.pipeline.schedules import Action, ScheduleError, build_schedule, stage_ticks
from paratrain.parallel.pipeline.timeline import measured_bubble, read_timeline
from tests.back_to_back_runs import back_to_back_run

KINDS = {"F": "forward", "B": "backward", "W": "weight"}
CASES = [
    (name, stages, micro, chunks)
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h2", 1))
    for stages, micro in ((2, 2), (2, 4), (3, 6), (4, 8), (4, 12))
]


def ticks(stage: int, chunk: int, kind: str) -> float:
    """simulated_bubble's default clock: F 1, B 2 (split: B 1 and W 1)."""
    return {"F": 1.0, "B": 2.0, "W": 1.0}[kind]


def split_ticks(stage: int, chunk: int, kind: str) -> float:
    """The same clock split: B 1 and W 1, but on the first stage B 0 and W 2."""
    return stage_ticks(stage, 1.0, 2.0, 1.0, split=True)[kind]


@pytest.mark.parametrize(("name", "stages", "micro", "chunks"), CASES)
def test_equal_times_and_free_messages_give_the_simulators_bubble(name, stages, micro, chunks):
    schedule = build_schedule(name, stages, micro, chunks)
    split = name.startswith("zb")
    durations = split_ticks if split else ticks
    assert replayed_bubble(schedule, durations) == pytest.approx(
        simulated_bubble(schedule), rel=1e-12
    )


def test_a_hand_worked_two_stage_1f1b_with_unequal_stages_and_a_message_time():
    """p = 2, m = 2. Stage 0 runs F0 F1 B0 B1 (F 2 ms, B 3 ms), stage 1 runs F0 B0 F1 B1
    (F 1 ms, B 5 ms; it holds the loss), each message 0.5 ms:

        stage 0: F0 [0, 2]  F1 [2, 4]
        stage 1: F0 [2 + 0.5, 3.5]  B0 [3.5, 8.5] (its own F0: no message)
                 F1 [max(8.5, 4 + 0.5), 9.5]  B1 [9.5, 14.5]
        stage 0: B0 [max(4, 8.5 + 0.5), 12]  B1 [max(12, 14.5 + 0.5), 18]

    makespan 18 ms; busy 10 ms (stage 0) and 12 ms (stage 1); bubble
    (8/18 + 6/18) / 2 = 7/18, against the textbook 1/3 for equal stages and free messages.
    """
    ms = {(0, 0, "F"): 2.0, (0, 0, "B"): 3.0, (1, 0, "F"): 1.0, (1, 0, "B"): 5.0}
    found = replay(build_schedule("1f1b", 2, 2), ms, hop_s=0.5)  # ms as plain numbers
    assert [[(s.start, s.end) for s in row] for row in found.slots] == [
        [(0, 2), (2, 4), (9, 12), (15, 18)],
        [(2.5, 3.5), (3.5, 8.5), (8.5, 9.5), (9.5, 14.5)],
    ]
    assert (found.makespan, found.busy) == (18, [10, 12])
    assert found.bubble == pytest.approx(7 / 18, rel=1e-12)
    assert found.imbalance == pytest.approx(1.2, rel=1e-12)


def test_messages_between_chunks_of_one_device_cost_nothing():
    """One device holding two chunks: every dependency stays on it, so a hop changes
    nothing; the same chunks over two devices pay it."""
    one = build_schedule("1f1b", 1, 2, 2)
    assert replay(one, split_ticks, hop_s=5.0).makespan == replay(one, split_ticks).makespan
    two = build_schedule("1f1b", 2, 2, 2)
    assert replay(two, split_ticks, hop_s=5.0).makespan > replay(two, split_ticks).makespan


def test_a_deadlocking_list_and_bad_times_are_refused():
    stuck = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ScheduleDeadlock, match="stage 1 at B0"):
        replay(stuck, split_ticks)
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="no duration given"):
        replay(schedule, {(0, 0, "F"): 1.0})
    with pytest.raises(ScheduleError, match="hop_s must be finite and >= 0"):
        replay(schedule, ticks, hop_s=-1.0)
    with pytest.raises(ScheduleError, match="finite and >= 0"):
        replay(schedule, lambda s, c, k: float("nan"))


# Unequal stages (stage 1 holds the loss: slower B), seconds, and a message time.
TRUE = {
    (0, "F"): 3.25e-3,
    (0, "B"): 1.5e-3,
    (0, "W"): 4.875e-3,
    (1, "F"): 3.125e-3,
    (1, "B"): 3.25e-3,
    (1, "W"): 5.25e-3,
}
HOP = 0.75e-3


def _synthetic_run(
    tmp_path,
    name: str,
    stages: int,
    micro: int,
    chunks: int = 1,
    *,
    late: float = 0.0,
    late_steps: tuple[int, ...] = (0, 1, 2),
    delayed: tuple[int, int, str, int, float] | None = None,
):
    """Three steps of ``name`` replayed on TRUE (a stage's chunks alike; an unsplit B is
    B + W) and HOP, one second apart, written as the engine writes its timeline; step 0
    runs everything 1 ms slower (warm-up), which the replay must leave out; with ``late``,
    stage 1's B of micro-batch 0 takes that much longer in every step of ``late_steps``;
    with ``delayed`` (stage, chunk, kind, micro, seconds), that pass starts so much later
    than it could in every step, lasting its own time (an engine's gap before it)."""
    schedule = build_schedule(name, stages, micro, chunks)
    split = name.startswith("zb")

    def seconds(stage, chunk, kind, slow=0.0):
        base = TRUE[(stage % 2, kind)] + (0 if split or kind != "B" else TRUE[(stage % 2, "W")])
        return base + slow

    meta = {"kind": "meta", "stages": stages, "micro_batches": micro, "schedule": name}
    records = [{**meta, "replicas": 1, **({"virtual_stages": chunks} if chunks > 1 else {})}]
    for step in range(3):
        slow = 1e-3 if step == 0 else 0.0

        def gap(stage, action):
            key = (stage, action.chunk, action.kind, action.micro)
            return delayed[4] if delayed is not None and key == delayed[:4] else 0.0

        def length(stage, action, slow=slow, late_now=late if step in late_steps else 0.0):
            extra = late_now if (stage, action.kind, action.micro) == (1, "B", 0) else 0.0
            return seconds(stage, action.chunk, action.kind, slow) + extra + gap(stage, action)

        placed = place_actions(schedule, length, hop=HOP)
        for stage, row in enumerate(placed):
            for a, start, end in row:
                slot = Slot(a, start + gap(stage, a), end)
                records.append(
                    {
                        "kind": KINDS[a.kind],
                        **{"rank": stage, "stage": stage, "replica": 0, "step": step},
                        **{"micro": a.micro, "start": step + slot.start, "end": step + slot.end},
                        **({"chunk": a.chunk} if chunks > 1 else {}),
                    }
                )
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_timeline(path), replay(schedule, seconds, hop_s=HOP)


@pytest.mark.parametrize(
    ("name", "stages", "micro", "chunks"),
    [("1f1b", 2, 8, 1), ("zb-h1", 2, 8, 1), ("zb-h2", 4, 8, 1), ("1f1b", 2, 4, 2)],
)
def test_a_timeline_gives_back_its_pass_times_its_message_time_and_its_bubble(
    tmp_path, name, stages, micro, chunks
):
    timeline, truth = _synthetic_run(tmp_path, name, stages, micro, chunks)
    durations = stage_durations(timeline)
    kinds = "FBW" if name.startswith("zb") else "FB"
    assert set(durations) == {
        (s, c, k) for s in range(stages) for c in range(chunks) for k in kinds
    }
    for (stage, _, kind), value in durations.items():
        expected = TRUE[(stage % 2, kind)] + (
            TRUE[(stage % 2, "W")] if kinds == "FB" and kind == "B" else 0
        )
        assert value == pytest.approx(expected, abs=1e-12)
    assert message_time(timeline) == pytest.approx(HOP, abs=1e-12)
    bubble, hop = replayed_theory(timeline)
    assert hop == pytest.approx(HOP, abs=1e-12)
    assert bubble == pytest.approx(truth.bubble, abs=1e-10)
    assert bubble == pytest.approx(measured_bubble(timeline), abs=1e-10)
    assert timeline_replay(timeline).replay.imbalance == pytest.approx(truth.imbalance, abs=1e-10)
    assert stepwise_theory(timeline) == pytest.approx(truth.bubble, abs=1e-10)


def test_a_step_replayed_on_its_own_passes_keeps_the_wait_a_late_pass_causes(tmp_path):
    """Stage 1's backward of micro-batch 0 runs 3 units late in one step: the median
    replay does not see it, the step's own replay waits as the run did."""
    timeline, truth = _synthetic_run(tmp_path, "1f1b", 2, 4, 1, late=3.0)
    steps = sorted({e.step for e in timeline.events})
    assert stepwise_theory(timeline) == pytest.approx(measured_bubble(timeline), abs=1e-10)
    assert step_replay(timeline, steps[1], hop_s=HOP).bubble > truth.bubble


def test_each_step_is_judged_against_its_own_replay(tmp_path):
    """Where the engine adds nothing, each step's measured bubble is its own replay's,
    a late pass included (the wait it causes is the schedule's); a gap before one pass in
    every step raises each step's ratio by what that gap adds to the step's idle time."""
    timeline, _ = _synthetic_run(tmp_path, "1f1b", 2, 4, 1, late=3.0, late_steps=(1,))
    ratios = stepwise_ratios(timeline, hop_s=HOP)
    assert len(ratios) == 2  # the measured steps: the warm-up step is left out
    assert ratios == pytest.approx([1.0, 1.0], abs=1e-9)  # step 1's late pass, step 2 none
    # the steps differ: the median measured step against the median replay would not be 1
    assert measured_bubble(timeline) / stepwise_theory(timeline, hop_s=HOP) != pytest.approx(1)
    timeline, truth = _synthetic_run(tmp_path, "zb-h1", 2, 4, delayed=(1, 0, "F", 2, 0.4e-3))
    expected = measured_bubble(timeline) / truth.bubble
    assert expected > 1.0
    assert stepwise_ratios(timeline, hop_s=HOP) == pytest.approx([expected] * 2, abs=1e-9)


def test_a_timeline_with_several_rounds_per_step_is_refused(tmp_path):
    timeline, _ = _synthetic_run(tmp_path, "1f1b", 2, 4)
    doubled = [e for e in timeline.events] + [e for e in timeline.events if e.step == 1]
    timeline.events[:] = doubled
    with pytest.raises(ValueError, match="gradient_accumulation=1"):
        replayed_theory(timeline)


def test_a_timeline_event_names_a_chunk_the_meta_line_has_not(tmp_path):
    meta = {"kind": "meta", "stages": 1, "micro_batches": 1, "schedule": "1f1b", "replicas": 1}
    event = {"kind": "forward", "rank": 0, "stage": 0, "replica": 0, "step": 0, "micro": 0}
    path = tmp_path / "timeline.jsonl"
    path.write_text(
        json.dumps(meta) + "\n" + json.dumps({**event, "start": 0, "end": 1, "chunk": 1})
    )
    with pytest.raises(ValueError, match="names chunk 1, but the meta line says there are 1"):
        read_timeline(path)


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("1f1b", 2)])
def test_engine_gaps_are_zero_where_the_run_is_its_replay_and_find_a_late_start(
    tmp_path, name, chunks
):
    """A run placed by the replay's own rules has no gap at any pass; delaying the start
    of stage 1's forward of micro-batch 2 (chunk 0) by 0.4 ms, its duration kept, shows
    that gap at that pass in each measured step, bound by what bound it undelayed, and
    nowhere else: the passes after it start as early as they can after it."""
    timeline, _ = _synthetic_run(tmp_path, name, 2, 4, chunks)
    gaps = engine_gaps(timeline)
    # 1e-12 s: a gap is a few float64 sums and differences of times below 3 s, each off
    # by at most 2^-52 x 3 (7e-16); pure Python arithmetic, alike on any CPU
    assert gaps and max(abs(g.seconds) for g in gaps) < 1e-12
    # every pass of the 2 measured steps but stage 0's first, which waits for nothing
    assert len(gaps) == 2 * (sum(len(row) for row in build_schedule(name, 2, 4, chunks)) - 1)
    bound = {(g.stage, g.chunk, g.kind, g.micro): g.bound for g in gaps}[1, 0, "F", 2]
    timeline, _ = _synthetic_run(tmp_path, name, 2, 4, chunks, delayed=(1, 0, "F", 2, 0.4e-3))
    late = [g for g in engine_gaps(timeline, hop_s=HOP) if abs(g.seconds) > 1e-12]
    assert [(g.stage, g.chunk, g.kind, g.micro, g.bound) for g in late] == [
        (1, 0, "F", 2, bound)
    ] * 2
    assert [g.step for g in late] == [1, 2]
    assert all(g.seconds == pytest.approx(0.4e-3, abs=1e-12) for g in late)


def test_steps_run_back_to_back_are_replayed_from_when_each_stage_began_them(tmp_path):
    """Under ZB-H1's lists for steps back to back the last stage still runs a step's last
    W passes when the next step's first activation reaches it (checked below). Replayed
    from when each stage began each step (the timeline's ``ready`` records), every step is
    its own replay and no pass has a gap; replayed as if every stage began with the step,
    the same steps would seem to idle more than their lists must, the engine blamed for
    the previous step's work."""
    timeline, placed = back_to_back_run(tmp_path, TRUE, HOP, began=True)
    assert not timeline.flush and timeline.ready[0, 1, 1] > 1.0
    last_w = max(end for a, _, end in placed[1][:12] if a.micro < 4)
    next_f = min(start for a, start, _ in placed[0] if a.micro == 4)
    assert next_f < last_w  # the steps overlap: the next step began before this one ended
    assert stepwise_ratios(timeline, hop_s=HOP) == pytest.approx([1.0, 1.0], abs=1e-9)
    gaps = engine_gaps(timeline, hop_s=HOP)
    assert gaps and max(abs(g.seconds) for g in gaps) < 1e-12
    unknown, _ = back_to_back_run(tmp_path, TRUE, HOP, began=False)
    assert unknown.flush is False and not unknown.ready
    assert min(stepwise_ratios(unknown, hop_s=HOP)) > 1.05
