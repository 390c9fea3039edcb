"""ZB-H1's lists for steps that follow each other with no barrier (``zb_h1(flush=False)``),
and the clock that places runs of steps (``schedule_clock.back_to_back``,
``steady_step``).

Every figure here is on integer or quarter ticks, so exact in floats: no tolerance."""

from __future__ import annotations

import pytest

from paratrain.parallel.pipeline.schedule_clock import (
    back_to_back,
    place_actions,
    simulate,
    steady_step,
)
from paratrain.parallel.pipeline.schedules import (
    Action,
    ScheduleError,
    build_schedule,
    max_in_flight,
    one_f_one_b,
    stage_ticks,
    zb_h1,
)

SIZES = [(2, 1), (2, 2), (2, 4), (2, 8), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)]


def _unit(stages: int):
    """F = B = W = 1 tick, the first stage's backward (its W) 2: ``stage_ticks``."""
    ticks = [stage_ticks(s, 1, 2, 1, split=True) for s in range(stages)]
    return lambda stage, action: ticks[stage][action.kind]


def test_steps_back_to_back_number_each_run_s_micro_batches_after_the_last():
    lists = back_to_back(one_f_one_b(2, 2), 2)
    assert [a.label() for a in lists[1]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [a.label() for a in lists[0]] == ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3"]


def test_a_steady_step_pays_each_stage_s_pause_and_a_released_stage_waits():
    """1F1B, 2 stages, 2 micro-batches, F = 1 and B = 2: a step alone spans (m + p - 1)
    (F + B) = 9 ticks, each stage busy 6 of them; back to back, the next step starts when
    the first stage is free again (its last B ends the step), so the period is that span
    plus the first stage's pause between steps; every tick of it not busy is idle, and
    every idle tick but the pause a wait for the other stage."""
    length = lambda stage, action: {"F": 1, "B": 2}[action.kind]  # noqa: E731
    alone = steady_step(one_f_one_b(2, 2), length)
    assert (alone.period, alone.busiest_idle, alone.waiting) == (9, 3, 3)
    paused = steady_step(one_f_one_b(2, 2), length, between=lambda stage: 0.5)
    # its own pause is no wait for another stage
    assert (paused.period, paused.busiest_idle, paused.waiting) == (9.5, 3.5, 3)
    with pytest.raises(ScheduleError, match="at least 2 steps"):
        steady_step(one_f_one_b(2, 2), length, steps=1)
    placed = place_actions(one_f_one_b(2, 2), length, hop=0, release=[0, 3])
    assert placed[1][0][1:] == (3, 4)  # its F0 waits for the stage, not for F0 of stage 0


@pytest.mark.parametrize(("stages", "micro"), SIZES)
def test_back_to_back_lists_run_in_order_and_never_idle_more_or_hold_more_than_flushed(
    stages, micro
):
    """Each kind in micro-batch order, no deadlock (``simulate``); per stage at least what
    the flushed lists hold (a later stage keeps W passes for the step's end) and, at the
    most any stage holds, no more; on the unit clock, steps back to back idle no more than
    the flushed lists' (the lists are chosen so, ``_steps_back_to_back``)."""
    ahead, flushed = zb_h1(stages, micro, flush=False), zb_h1(stages, micro)
    for actions in ahead:
        for kind in "FBW":
            assert [a.micro for a in actions if a.kind == kind] == list(range(micro))
    simulate(ahead, backward_ticks=2)
    held, before = max_in_flight(ahead), max_in_flight(flushed)
    assert all(a >= b for a, b in zip(held, before, strict=True)) and max(held) == max(before)
    length = _unit(stages)
    assert steady_step(ahead, length).busiest_idle <= steady_step(flushed, length).busiest_idle


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_back_to_back_lists_idle_one_tick_less_a_step_than_flushed_on_the_unit_clock(stages, micro):
    """Flushed ZB-H1 idles p - 1 ticks a step on the unit clock, back to back as alone;
    without a barrier its later stages run their last W passes while the first starts
    the next step, one tick a step less: p - 2 (none at 2 stages), against 1F1B's
    3(p - 1). At 2 stages the third of 1F1B's is met with room: 0 against 3."""
    length = _unit(stages)
    ahead = steady_step(zb_h1(stages, micro, flush=False), length).busiest_idle
    flushed = steady_step(zb_h1(stages, micro), length).busiest_idle
    plain = steady_step(one_f_one_b(stages, micro), lambda s, a: {"F": 1, "B": 2}[a.kind])
    assert (ahead, flushed, plain.busiest_idle) == (stages - 2, stages - 1, 3 * (stages - 1))


@pytest.mark.parametrize("pause", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("hop", [0.0, 0.25])
@pytest.mark.parametrize("micro", [4, 8, 16])
@pytest.mark.parametrize("layers", range(1, 7))
def test_a_data_fed_first_stage_keeps_zb_h1_back_to_back_under_a_third_of_1f1b(
    layers, micro, hop, pause
):
    """The setting of ``test_schedules``' equal stages, where a step alone cannot go
    under the third: two stages of k layers, F = B = W = 1 a layer, the first stage fed
    data (its backward 2k - 1), a message ``hop``, each stage's optimizer step ``pause``
    between steps. Steps back to back, the last stage (the busiest) idles a period:
    under 1F1B 3k - 1 + 2 hop + pause; under flushed ZB-H1 k - 1 + 2 hop + pause; under
    ZB-H1's lists for steps back to back only its own optimizer step, ``pause``. Less its
    own optimizer step (``waiting``), ZB-H1 back to back waits for nothing, the third
    with room, at any pause."""
    k = layers
    first, last = {"F": k, "B": 0, "W": 2 * k - 1}, {"F": k, "B": k, "W": k}
    plain_first, plain_last = {"F": k, "B": 2 * k - 1}, {"F": k, "B": 2 * k}

    def steady(lists, stages_ticks):
        return steady_step(
            lists,
            lambda s, action: stages_ticks[s][action.kind],
            hop=hop,
            between=lambda s: pause,
        )

    base = steady(one_f_one_b(2, micro), (plain_first, plain_last))
    assert (base.busiest_idle, base.waiting) == (3 * k - 1 + 2 * hop + pause, 3 * k - 1 + 2 * hop)
    flushed = steady(zb_h1(2, micro), (first, last))
    assert (flushed.busiest_idle, flushed.waiting) == (k - 1 + 2 * hop + pause, k - 1 + 2 * hop)
    ahead = steady(zb_h1(2, micro, flush=False), (first, last))
    assert (ahead.busiest_idle, ahead.waiting) == (pause, 0)


def test_only_zb_h1_has_lists_for_steps_back_to_back():
    assert build_schedule("zb-h1", 2, 8, flush=False) == zb_h1(2, 8, flush=False)
    assert build_schedule("zb-h1", 2, 8) == zb_h1(2, 8) != zb_h1(2, 8, flush=False)
    for name in ("gpipe", "1f1b", "zb-h2"):
        assert build_schedule(name, 2, 8, flush=False) == build_schedule(name, 2, 8)
    assert build_schedule("1f1b", 2, 8, 2, flush=False) == build_schedule("1f1b", 2, 8, 2)
    last = [a.label() for a in zb_h1(2, 8, flush=False)[1]]
    assert last[-5:] == ["F7", "B7", "W5", "W6", "W7"]  # three W for the step's end
    assert zb_h1(2, 8, flush=False) is not zb_h1(2, 8, flush=False)  # fresh lists each call
    zb_h1(2, 8, flush=False)[1].append(Action("F", 0))
    assert len(zb_h1(2, 8, flush=False)[1]) == 24  # a caller's edit stays its own
