"""Pipeline schedules: exact action lists and clock tables, bubbles, memory bound, deadlocks."""

from __future__ import annotations

import random

import pytest

from paratrain.parallel.pipeline import schedules
from paratrain.parallel.pipeline.replay import replay
from paratrain.parallel.pipeline.schedule_clock import (
    ScheduleDeadlock,
    clock_table,
    place_actions,
    simulate,
    simulated_bubble,
)
from paratrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    splits_backward,
    stage_ticks,
    zb_h1,
)


def labels(schedule, chunks=1):
    return [" ".join(a.label(chunks=chunks) for a in actions) for actions in schedule]


# ---------------------------------------------------------------- action lists


def test_gpipe_runs_all_forwards_then_backwards_in_micro_order():
    assert labels(gpipe(2, 3)) == ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"]


def test_one_f_one_b_warms_up_with_stages_minus_stage_minus_one_forwards():
    assert labels(one_f_one_b(3, 4)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_one_f_one_b_with_fewer_micro_batches_than_warm_up():
    assert labels(one_f_one_b(4, 2)) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_interleaved_orders_groups_of_stages_by_chunk():
    assert labels(interleaved_1f1b(2, 4, 2), chunks=2) == [
        "F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a B2b B3b B2a B3a",
        "F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a",
    ]
    assert interleaved_1f1b(2, 2, 2)[0][2] == Action("F", 0, 1)


# ---------------------------------------------------------------- clock tables

TABLES = {
    ("gpipe", 2, 2): [
        "F0 F1 .  .  B0 B1",
        ".  F0 F1 B0 B1 .",
    ],
    ("gpipe", 2, 4): [
        "F0 F1 F2 F3 .  .  B0 B1 B2 B3",
        ".  F0 F1 F2 F3 B0 B1 B2 B3 .",
    ],
    ("gpipe", 4, 4): [
        "F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3",
        ".  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .",
        ".  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .",
        ".  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .",
    ],
    ("gpipe", 4, 8): [
        "F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7",
        ".  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .",
        ".  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .",
        ".  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .",
    ],
    ("1f1b", 2, 2): [
        "F0 F1 .  B0 .  B1",
        ".  F0 B0 F1 B1 .",
    ],
    ("1f1b", 2, 4): [
        "F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        ".  F0 B0 F1 B1 F2 B2 F3 B3 .",
    ],
    ("1f1b", 4, 4): [
        "F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3",
        ".  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .",
        ".  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .",
        ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .",
    ],
    ("1f1b", 4, 8): [
        "F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7",
        ".  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .",
        ".  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .",
        ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .",
    ],
}


@pytest.mark.parametrize("key", list(TABLES), ids=lambda k: f"{k[0]}-p{k[1]}-m{k[2]}")
def test_clock_tables_with_unit_ticks(key):
    name, stages, micro = key
    assert clock_table(get_schedule(name)(stages, micro)) == TABLES[key]


def test_clock_tables_with_backward_twice_as_long_as_forward():
    assert clock_table(gpipe(2, 2), backward_ticks=2) == [
        "F0 F1 .  .  .  B0 B0 B1 B1",
        ".  F0 F1 B0 B0 B1 B1 .  .",
    ]
    assert clock_table(one_f_one_b(2, 4), backward_ticks=2) == [
        "F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3",
        ".  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .",
    ]


def test_interleaved_clock_tables():
    assert clock_table(interleaved_1f1b(2, 2, 2)) == [
        "F0a F1a F0b F1b .   B0b .   B1b B0a B1a",
        ".   F0a F1a F0b B0b F1b B1b B0a B1a .",
    ]
    assert clock_table(interleaved_1f1b(4, 8, 2)) == [
        "F0a F1a F2a F3a F0b F1b F2b F3b F4a F5a F6a B0b F7a B1b .   .   F4b B2b F5b B3b "
        "F6b B0a F7b B1a B2a B3a .   B4b .   B5b .   B6b .   B7b B4a B5a B6a B7a",
        ".   F0a F1a F2a F3a F0b F1b F2b F3b F4a B0b F5a B1b F6a B2b F7a B3b F4b B0a F5b "
        "B1a F6b B2a F7b B3a .   B4b .   B5b .   B6b .   B7b B4a B5a B6a B7a .",
        ".   .   F0a F1a F2a F3a F0b F1b F2b B0b F3b B1b F4a B2b F5a B3b F6a B0a F7a B1a "
        "F4b B2a F5b B3a F6b B4b F7b B5b .   B6b .   B7b B4a B5a B6a B7a .   .",
        ".   .   .   F0a F1a F2a F3a F0b B0b F1b B1b F2b B2b F3b B3b F4a B0a F5a B1a F6a "
        "B2a F7a B3a F4b B4b F5b B5b F6b B6b F7b B7b B4a B5a B6a B7a .   .   .",
    ]


def test_simulate_places_actions_on_exact_ticks():
    placed = simulate(one_f_one_b(2, 2), backward_ticks=2)
    assert [(t.action.label(), t.start, t.end) for t in placed[0]] == [
        ("F0", 0, 1),
        ("F1", 1, 2),
        ("B0", 4, 6),
        ("B1", 7, 9),
    ]


# ---------------------------------------------------------------- bubbles and memory

SIZES = [(p, m) for p in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("backward_ticks", [1, 2, 3])
def test_simulated_bubble_equals_theory(name, backward_ticks):
    for stages, micro in SIZES:
        schedule = get_schedule(name)(stages, micro)
        bubble = simulated_bubble(schedule, backward_ticks=backward_ticks)
        assert bubble == (stages - 1) / (micro + stages - 1), (stages, micro)


def test_known_bubble_values():
    assert simulated_bubble(gpipe(4, 4)) == 3 / 7
    assert simulated_bubble(one_f_one_b(4, 8)) == 3 / 11
    assert simulated_bubble(gpipe(1, 5)) == 0.0


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_interleaved_bubble_shrinks_by_the_chunk_count(chunks):
    for stages in range(1, 6):
        for micro in range(stages, 4 * stages + 1, stages):
            schedule = interleaved_1f1b(stages, micro, chunks)
            for backward_ticks in (1, 2):
                bubble = simulated_bubble(schedule, backward_ticks=backward_ticks)
                assert bubble == (stages - 1) / (chunks * micro + stages - 1)


def test_max_in_flight():
    assert max_in_flight(gpipe(4, 8)) == [8, 8, 8, 8]
    assert max_in_flight(one_f_one_b(4, 8)) == [4, 3, 2, 1]
    assert max_in_flight(one_f_one_b(4, 2)) == [2, 2, 2, 1]
    assert max_in_flight(interleaved_1f1b(4, 8, 2)) == [11, 9, 7, 5]
    for stages, micro in SIZES:
        assert max_in_flight(gpipe(stages, micro)) == [micro] * stages
        assert max_in_flight(one_f_one_b(stages, micro)) == [
            min(stages - s, micro) for s in range(stages)
        ]


# ---------------------------------------------------------------- refusals and deadlocks


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="stages must be a positive integer, not 0"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer, not 0"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="stages must be a positive integer, not True"):
        gpipe(True, 4)
    with pytest.raises(ValueError, match="6 is not a multiple of 4; use a multiple of 4"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="chunks must be a positive integer, not 0"):
        interleaved_1f1b(2, 4, 0)
    with pytest.raises(ValueError, match="backward_ticks must be a positive integer"):
        simulate(gpipe(2, 2), backward_ticks=0)
    with pytest.raises(ScheduleError, match="kind must be 'F', 'B' or 'W'"):
        Action("X", 0)


def test_get_schedule_names_the_choices():
    assert get_schedule("gpipe") is gpipe
    assert get_schedule("1f1b") is one_f_one_b
    assert get_schedule("zb-h1") is zb_h1
    assert sorted(SCHEDULES) == ["1f1b", "gpipe", "zb-h1", "zb-h2"]
    with pytest.raises(
        ScheduleError, match="unknown pipeline schedule 'zb'; choose one of gpipe, 1f1b"
    ):
        get_schedule("zb")


def test_cyclic_wait_is_reported_as_a_deadlock():
    F, B = (lambda m: Action("F", m)), (lambda m: Action("B", m))
    # Stage 0 wants B0 before F1; stage 1 wants F1 before B0: each waits for the other.
    cyclic = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1), B(0)]]
    with pytest.raises(ScheduleDeadlock, match="stage 0 at B0, stage 1 at F1"):
        simulate(cyclic)
    with pytest.raises(ScheduleDeadlock, match="stage 0 at B0"):
        simulate([[B(0), F(0)]])  # a backward before its own forward


def test_malformed_schedules_are_refused():
    F, B = (lambda m: Action("F", m)), (lambda m: Action("B", m))
    with pytest.raises(ScheduleError, match="stage 1 runs B"):
        simulate([[F(0), B(0)], [F(0)]])
    with pytest.raises(ScheduleError, match="stage 0 runs some F action twice"):
        simulate([[F(0), F(0), B(0)]])
    with pytest.raises(ScheduleError, match="at least one stage"):
        simulate([])


def test_every_shipped_schedule_completes():
    for stages, micro in SIZES:
        for name in SCHEDULES:
            schedule = get_schedule(name)(stages, micro)
            placed = simulate(schedule, backward_ticks=2)
            kinds = 3 if splits_backward(schedule) else 2
            assert [len(slots) for slots in placed] == [kinds * micro] * stages
        if micro % stages == 0:
            for chunks in (1, 2, 3):
                placed = simulate(interleaved_1f1b(stages, micro, chunks))
                assert [len(slots) for slots in placed] == [2 * micro * chunks] * stages


ZB_SIZES = [(1, 3), (2, 1), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16)]


def _idle_ticks_per_stage(schedule, **ticks) -> float:
    placed = simulate(schedule, **ticks)
    makespan = max(slot.end for slots in placed for slot in slots)
    return simulated_bubble(schedule, **ticks) * makespan


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p, m in ZB_SIZES if m >= p])
def test_zb_h1_reaches_the_papers_bubble_a_third_of_1f1bs(stages, micro):
    """With F = B = W = 1 tick (m >= p) the paper's ZB-H1 idles ``(p - 1)(T_F + T_B -
    T_W)`` = p - 1 ticks per stage; 1F1B, its backward B + W = 2 ticks, idles 3(p - 1)."""
    schedule = zb_h1(stages, micro)
    assert splits_backward(schedule) and not splits_backward(one_f_one_b(stages, micro))
    bubble = simulated_bubble(schedule, backward_ticks=2, weight_ticks=1)
    assert bubble == pytest.approx((stages - 1) / (3 * micro + stages - 1), abs=1e-12)
    idle = _idle_ticks_per_stage(schedule, backward_ticks=2)
    one_f = _idle_ticks_per_stage(one_f_one_b(stages, micro), backward_ticks=2)
    assert idle == pytest.approx(stages - 1) and one_f == pytest.approx(3 * (stages - 1))


@pytest.mark.parametrize(("stages", "micro"), ZB_SIZES)
def test_zb_h1_runs_each_kind_in_order_and_bounds_what_it_holds(stages, micro):
    for s, actions in enumerate(zb_h1(stages, micro)):
        for kind in "FBW":
            assert [a.micro for a in actions if a.kind == kind] == list(range(micro))
        between, pending, peak_between, peak_pending = 0, 0, 0, 0
        for action in actions:
            between += {"F": 1, "B": -1}.get(action.kind, 0)
            pending += {"B": 1, "W": -1}.get(action.kind, 0)
            peak_between, peak_pending = max(peak_between, between), max(peak_pending, pending)
        if s:  # the first stage's B is empty: its bound is what it holds (below)
            assert peak_between <= min(stages - s, micro)  # 1F1B's bound between F and B
        assert peak_pending <= stages
    # F to W: both counted; 2p - 1 - s but on the first stage, whose W follows its empty B
    # sooner (``stage_ticks``)
    assert max_in_flight(zb_h1(4, 8)) == [6, 6, 5, 4]


def _plain_zb_h1(stages: int, micro: int):
    """ZB-H1's rule with 1F1B's bound between F and B on the first stage too."""
    return schedules._played(stages, micro, schedules._zb_h1_choice)


FIRST_STAGE_SIZES = [(p, m) for p in (2, 3, 4, 6, 8) for m in sorted({p, 2 * p - 1, 2 * p, 4 * p})]


@pytest.mark.parametrize(("stages", "micro"), FIRST_STAGE_SIZES)
def test_zb_h1s_first_stage_runs_forwards_within_what_it_holds_at_its_peak(stages, micro):
    """The first stage's B is empty, so 1F1B's bound between F and B bounds none of its
    memory; bounded by what it holds instead (F done, W not) at the plain rule's peak, its
    lists hold no more anywhere: the same peak on every stage, and each B and W holding no
    more activations and kept gradients than one of the plain lists' does
    (``split_occupancy``, what the planner prices). The unit clock's bubble stays the
    paper's, and on random stage times (each a forward, B and W, the first stage's W its
    whole backward, a message time) the lists never take longer than the plain ones."""
    ours, plain = zb_h1(stages, micro), _plain_zb_h1(stages, micro)
    assert max_in_flight(ours) == max_in_flight(plain)
    for mine, theirs in zip(ours, plain, strict=True):
        held = schedules.split_occupancy(theirs)
        for _, holding, kept in schedules.split_occupancy(mine):
            assert any(holding <= h and kept <= k for _, h, k in held)
    # the bubble is a fraction of integer tick counts: equal up to one float64 rounding
    assert simulated_bubble(ours) == pytest.approx(simulated_bubble(plain), abs=1e-12)
    rng = random.Random(stages * 1000 + micro)
    for _ in range(40):
        times = {}
        for s in range(stages):
            forward = rng.uniform(2.0, 8.0)
            backward = rng.uniform(1.2, 2.5) * forward
            weight = rng.uniform(0.3, 0.6) * backward
            split = (0.0, backward) if s == 0 else (backward - weight, weight)
            times |= {(s, 0, "F"): forward, (s, 0, "B"): split[0], (s, 0, "W"): split[1]}
        hop = rng.uniform(0.0, 0.5)
        longest = replay(plain, times, hop_s=hop).makespan
        # sums of the same durations in another order: within float64 rounding of them
        assert replay(ours, times, hop_s=hop).makespan <= longest * (1 + 1e-12)


def test_zb_h1s_loaded_first_stage_no_longer_waits_for_the_first_gradient():
    """The bench's mlp-first-loaded at 2 x 8 (its stage times on the 2-core machine, ms):
    the first stage, with more work than the last, idled 2.8 ms a step waiting for the
    first output gradient before its third forward; with its bound what it holds it runs
    that forward first, and idles none."""
    times = {(0, 0, "F"): 5.4, (0, 0, "B"): 0.0, (0, 0, "W"): 10.4}
    times |= {(1, 0, "F"): 4.0, (1, 0, "B"): 4.2, (1, 0, "W"): 3.4}

    def first_stage_idle(schedule) -> float:
        placed = replay(schedule, times, hop_s=0.01)
        return placed.makespan - placed.busy[0]

    assert first_stage_idle(_plain_zb_h1(2, 8)) > 2.5
    assert first_stage_idle(zb_h1(2, 8)) == pytest.approx(0.0, abs=1e-9)
    assert [a.label() for a in zb_h1(2, 8)[0][:4]] == ["F0", "F1", "F2", "B0"]


def test_zb_h1_clock_table_shows_w_filling_the_bubble():
    """The first stage, fed data, runs each B in no tick and each W as its whole backward
    (2 ticks), so no B shows on its row; 13 ticks = 3m + p - 1, the paper's bubble. Its
    third forward runs before the first gradient comes (its bound is what it holds), so
    its idle tick falls before its last W instead of after its second forward."""
    assert clock_table(zb_h1(2, 4), backward_ticks=2) == [
        "F0 F1 F2 W0 W0 F3 W1 W1 W2 W2 .  W3 W3",
        ".  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ]


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p, m in ZB_SIZES if m >= 2 * p])
def test_zb_h1_keeps_its_third_with_the_first_stage_running_its_backward_as_w(stages, micro):
    """Played with B = W = 1 on the first stage too, the rule deferred that stage's W
    passes (each, as the engine runs it, a whole backward) behind the last gradient, and
    the lists idled 2(p - 1) ticks, two thirds of 1F1B's 3(p - 1), on the engine's clock.
    Replayed here by ``place_actions`` on that clock (stage 0: F 1, B 0, W 2; the others 1
    each; integer ticks, so exact): p - 1, the third; the lists the rule plays with B =
    W = 1 on every stage, 2(p - 1)."""
    clock = [stage_ticks(s, 1, 2, 1, split=True) for s in range(stages)]

    def idle(schedule) -> int:
        placed = place_actions(schedule, lambda s, a: clock[s][a.kind], hop=0)
        return max(end for slots in placed for _, _, end in slots) - 3 * micro

    unit = [{"F": 1, "B": 1, "W": 1}] * stages
    assert idle(zb_h1(stages, micro)) == stages - 1
    assert idle(schedules._played(stages, micro, schedules._zb_h1_choice, unit)) == 2 * (stages - 1)


@pytest.mark.parametrize("hop", [0.0, 0.25])
@pytest.mark.parametrize("micro", [4, 8, 16])
@pytest.mark.parametrize("layers", range(1, 7))
def test_a_data_fed_first_stage_holds_zb_above_a_third_of_1f1b_on_equal_stages(layers, micro, hop):
    """Why the bench's balanced splits cannot show ZB-H1 idling a third of 1F1B's in a
    step (steps that overlap could: docs/benchmarks.md): two stages of ``layers`` layers
    each, F = B = W = 1 per layer, a message ``hop`` ticks, and the first stage fed data,
    so its backward makes no input gradient for its first layer (2k - 1 ticks, not the
    2k the paper's equal stages have). The last stage does the most work; under ZB-H1 and
    ZB-H2 it idles only its wait for the first forward to reach it, k + hop, which no
    schedule that ends the step with an optimizer step can remove; under 1F1B it idles
    that and the first stage's last backward, 3k - 1 + 2 hop. The ratio (k + hop) /
    (3k - 1 + 2 hop) is above a third for every k (0.50 at one layer, 0.35 at six) and
    only tends to it. Integer and quarter ticks: exact in floats."""
    k = layers

    def idle_of_last(schedule, split: bool) -> float:
        first = {"F": k, "B": 0, "W": 2 * k - 1} if split else {"F": k, "B": 2 * k - 1}
        last = {"F": k, "B": k, "W": k} if split else {"F": k, "B": 2 * k}
        placed = replay(schedule, lambda s, c, kind: (first, last)[s][kind], hop_s=hop)
        assert placed.busy[1] > placed.busy[0]  # the last stage is the busiest
        return placed.makespan - placed.busy[1]

    base = idle_of_last(one_f_one_b(2, micro), split=False)
    assert base == 3 * k - 1 + 2 * hop
    for build in (zb_h1, schedules.zb_h2):
        idle = idle_of_last(build(2, micro), split=True)
        assert idle == k + hop
        assert idle / base > 1 / 3


def test_a_split_backward_needs_room_for_both_parts_and_every_w():
    with pytest.raises(ScheduleError, match="1 <= weight_ticks < backward_ticks"):
        simulate(zb_h1(2, 2), backward_ticks=1)
    missing_w = [[a for a in actions if (a.kind, a.micro) != ("W", 1)] for actions in zb_h1(2, 2)]
    with pytest.raises(ScheduleError, match="runs W for"):
        simulate(missing_w, backward_ticks=2)
    early_w = [[Action("F", 0), Action("W", 0), Action("B", 0)]]
    with pytest.raises(ScheduleDeadlock):
        simulate(early_w, backward_ticks=2)
