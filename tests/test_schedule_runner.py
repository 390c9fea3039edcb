"""The pipeline's schedule runner executes any schedule given as data, in its order."""

from __future__ import annotations

import pytest

from paratrain.parallel.pipeline.runner import ScheduleRunner
from paratrain.parallel.pipeline.schedules import (
    Action,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)


class _Link:
    def __init__(self, calls: list, chunk: int = 0) -> None:
        self.calls, self.chunk = calls, chunk

    def begin_round(self, micro_batches: int, *, expect_loss: bool) -> None:
        self.calls.append(
            ("begin", micro_batches, expect_loss) + ((self.chunk,) if self.chunk else ())
        )

    def flush(self) -> None:
        self.calls.append(("flush",) + ((self.chunk,) if self.chunk else ()))


class _Memory:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def book_communication(self) -> None:
        self.calls.append(("book",))


class _Passes:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def forward(self, micro: int, chunk: int) -> float:
        self.calls.append(("F", micro) + ((chunk,) if chunk else ()))
        return 0.0

    def backward(self, micro: int, chunk: int, *, last: bool) -> float:
        self.calls.append(("B", micro, last) + ((chunk,) if chunk else ()))
        return 0.0

    def weight(self, micro: int, chunk: int, *, last: bool) -> float:
        self.calls.append(("W", micro, last) + ((chunk,) if chunk else ()))
        return 0.0

    def after_last(self) -> None:
        self.calls.append(("after last",))

    def after_last_input(self) -> None:
        self.calls.append(("after last B",))


def _run(schedule, stage: int, *, final: bool, chunks: int = 1) -> tuple[list, list]:
    calls: list = []
    events: list = []
    links = [_Link(calls, chunk) for chunk in range(chunks)]
    runner = ScheduleRunner(schedule, stage, links=links, memory=_Memory(calls), events=events)
    runner.run_round(_Passes(calls), micro_batches=3, step=7, final=final)
    return calls, events


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_the_runner_follows_the_stage_list_and_marks_only_the_final_backward(make):
    schedule = make(2, 3)
    calls, events = _run(schedule, 0, final=True)
    passes = [c for c in calls if c[0] in ("F", "B")]
    assert [(c[0], c[1]) for c in passes] == [(a.kind, a.micro) for a in schedule[0]]
    assert [c[2] for c in passes if c[0] == "B"] == [False, False, True]
    assert calls[0] == ("begin", 3, True) and calls[-1] == ("flush",)
    # a record of when the stage began the round, then one event per pass
    began, *events = events
    assert began["kind"] == "ready" and began["start"] <= events[0]["end"]
    assert calls.count(("book",)) == len(schedule[0]) == len(events)
    assert {e["step"] for e in [began, *events]} == {7}
    assert [e["kind"][0].upper() for e in events] == [a.kind for a in schedule[0]]
    # the final backward's own pass and booking come first, then what follows it
    assert calls[-4][0] == "B" and calls[-4][2] is True
    assert calls[-3:] == [("book",), ("after last",), ("flush",)]
    assert calls.count(("after last",)) == 1


def test_a_round_that_is_not_the_steps_last_marks_no_backward_last():
    calls, _ = _run(gpipe(2, 3), 1, final=False)
    assert calls[0] == ("begin", 3, False)
    assert not any(c[2] for c in calls if c[0] == "B")
    assert ("after last",) not in calls


@pytest.mark.parametrize("stage", [0, 1])
def test_a_split_backward_marks_its_last_w_and_follows_it_outside_the_timed_pass(stage):
    """Under ZB-H1 the step's last gradients are a W's: that W is marked, no B is, and
    ``after_last`` (the loss handed back, the replicas' reduction) runs once, after the
    W's event is recorded."""
    schedule = zb_h1(2, 4)
    calls, events = _run(schedule, stage, final=True)
    passes = [c for c in calls if c[0] in ("F", "B", "W")]
    assert [(c[0], c[1]) for c in passes] == [(a.kind, a.micro) for a in schedule[stage]]
    assert not any(c[2] for c in passes if c[0] == "B")
    assert [c[2] for c in passes if c[0] == "W"][-1] is True
    assert sum(c[2] for c in passes if c[0] == "W") == 1
    after = calls.index(("after last",))
    assert calls[after - 1] == ("book",) and calls[after - 2][0] == "W"
    assert len(events) == 1 + len(schedule[stage])  # and when the stage began the round
    # the last B is followed (outside its timed pass) by what needs only the forwards
    # (the last stage's loss leaves there), once, and only in the step's final round
    after_input = calls.index(("after last B",))
    last_b = max(i for i, c in enumerate(calls) if c[0] == "B")
    assert after_input == last_b + 2 and calls[last_b + 1] == ("book",)
    assert calls.count(("after last B",)) == 1
    assert ("after last B",) not in _run(schedule, stage, final=False)[0]


def test_a_new_schedule_is_data_the_runner_executes_unchanged():
    """A hand-written order no registered schedule has: the runner calls exactly it."""
    custom = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]]
    calls, _ = _run(custom, 0, final=True)
    assert [c[:2] for c in calls if c[0] in ("F", "B")] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert [c[2] for c in calls if c[0] == "B"] == [False, True]


def test_an_action_of_a_chunk_the_stage_does_not_hold_is_refused_in_one_sentence():
    chunked = [[Action("F", 0), Action("F", 0, chunk=1), Action("B", 0, chunk=1), Action("B", 0)]]
    with pytest.raises(ScheduleError, match="the stage holds 1 chunk"):
        ScheduleRunner(chunked, 0, links=[_Link([])], memory=_Memory([]), events=[])


def test_an_interleaved_schedule_runs_each_action_on_its_chunk_and_its_link():
    schedule = interleaved_1f1b(2, 4, 2)
    calls, events = _run(schedule, 1, final=True, chunks=2)
    passes = [c for c in calls if c[0] in ("F", "B")]
    chunk_of = [c[-1] if len(c) == (3 if c[0] == "F" else 4) else 0 for c in passes]
    assert [(c[0], c[1]) for c in passes] == [(a.kind, a.micro) for a in schedule[1]]
    assert chunk_of == [a.chunk for a in schedule[1]] == [e["chunk"] for e in events[1:]]
    # only the last chunk's link expects the step's loss; every link starts and flushes
    assert calls[:2] == [("begin", 3, False), ("begin", 3, True, 1)]
    assert calls[-2:] == [("flush",), ("flush", 1)]
    assert [c[2] for c in passes if c[0] == "B"][-1] is True
