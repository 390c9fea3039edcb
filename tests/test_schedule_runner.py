"""The pipeline's schedule runner executes any schedule given as data, in its order."""

from __future__ import annotations

import pytest

from paratrain.parallel.pipeline.runner import ScheduleRunner
from paratrain.parallel.pipeline.schedules import Action, ScheduleError, gpipe, one_f_one_b


class _Link:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def begin_round(self, micro_batches: int, *, expect_loss: bool) -> None:
        self.calls.append(("begin", micro_batches, expect_loss))

    def flush(self) -> None:
        self.calls.append(("flush",))


class _Memory:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def book_communication(self) -> None:
        self.calls.append(("book",))


class _Passes:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def forward(self, micro: int) -> float:
        self.calls.append(("F", micro))
        return 0.0

    def backward(self, micro: int, *, last: bool) -> float:
        self.calls.append(("B", micro, last))
        return 0.0


def _run(schedule, stage: int, *, final: bool) -> tuple[list, list]:
    calls: list = []
    events: list = []
    runner = ScheduleRunner(
        schedule, stage, link=_Link(calls), memory=_Memory(calls), events=events
    )
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
    assert calls.count(("book",)) == len(schedule[0]) == len(events)
    assert {e["step"] for e in events} == {7}
    assert [e["kind"][0].upper() for e in events] == [a.kind for a in schedule[0]]


def test_a_round_that_is_not_the_steps_last_marks_no_backward_last():
    calls, _ = _run(gpipe(2, 3), 1, final=False)
    assert calls[0] == ("begin", 3, False)
    assert not any(c[2] for c in calls if c[0] == "B")


def test_a_new_schedule_is_data_the_runner_executes_unchanged():
    """A hand-written order no registered schedule has: the runner calls exactly it."""
    custom = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]]
    calls, _ = _run(custom, 0, final=True)
    assert [c[:2] for c in calls if c[0] in ("F", "B")] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert [c[2] for c in calls if c[0] == "B"] == [False, True]


def test_an_action_of_a_second_chunk_is_refused_in_one_sentence():
    chunked = [[Action("F", 0), Action("F", 0, chunk=1), Action("B", 0, chunk=1), Action("B", 0)]]
    with pytest.raises(ScheduleError, match="holds one slice of the model"):
        ScheduleRunner(chunked, 0, link=_Link([]), memory=_Memory([]), events=[])
