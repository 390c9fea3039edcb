"""Schedules as the planner and the report see them: activations in flight, the bubble's
theory per schedule, W drawn and timed apart.

Tolerances: the ideal timelines below are built from the schedule simulator's integer
ticks scaled to milliseconds, so every duration and sum is exact in binary up to the
final divisions; ``abs=1e-12`` (as in ``test_timeline``) is a thousandfold margin.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratrain.parallel.cost_model import Run
from paratrain.parallel.layout import Layout
from paratrain.parallel.pipeline.cost import (
    _steps_end_together,
    _ties_span_stages,
    in_flight,
    placed_round,
    placed_steps,
)
from paratrain.parallel.pipeline.description import PipelineStrategy
from paratrain.parallel.pipeline.schedule_clock import simulate
from paratrain.parallel.pipeline.schedules import Action, build_schedule, chunk_occupancy
from paratrain.parallel.pipeline.timeline import (
    measured_bubble,
    read_timeline,
    schedule_bubble,
)
from paratrain.parallel.pipeline.timeline_report import summarize
from paratrain.planner.api import candidates
from paratrain.planner.measure import _Cut, _tied_layers

KINDS = {"F": "forward", "B": "backward", "W": "weight"}


def test_each_schedules_theory():
    assert schedule_bubble("1f1b", 2, 4) == (pytest.approx(1 / 5), "(p-1)/(m+p-1)")
    assert schedule_bubble("gpipe", 4, 8)[0] == pytest.approx(3 / 11)
    assert schedule_bubble("1f1b", 4, 8, virtual_stages=2) == (
        pytest.approx(3 / 19),
        "(p-1)/(vm+p-1)",
    )
    assert schedule_bubble("zb-h1", 4, 8)[0] == pytest.approx(3 / 27)  # F = B = W
    times = {"forward": 1.0, "backward": 1.0, "weight": 0.5}
    assert schedule_bubble("zb-h1", 2, 4, times=times)[0] == pytest.approx(1.5 / (10 + 1.5))


def test_the_planner_reads_activations_in_flight_off_each_schedule():
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    # F to W; the first stage's W follows its empty B sooner (``stage_ticks``)
    assert [in_flight("zb-h1", 4, s, 8) for s in range(4)] == [6, 6, 5, 4]
    # steps back to back: the later stages keep W passes for the step's end
    assert [in_flight("zb-h1", 4, s, 8, flush=False) for s in range(4)] == [6, 6, 5, 5]
    # interleaved: (micro-batch, chunk) pairs of half a stage each
    assert [in_flight("1f1b", 4, s, 8, 2) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]


def test_an_interleaved_stage_counts_each_chunks_activations_along_its_actions():
    """A chunk saving 1 byte a micro-batch and one saving 100 (an embedding and a block):
    as halves of a stage each pair would weigh 50.5."""
    actions = build_schedule("1f1b", 2, 4, 2)[0]
    peak, backwards = chunk_occupancy(actions, [1.0, 100.0], "B")
    held = [0.0]
    for action in actions:  # the same walk, written out: bytes in flight after each action
        step = {"F": 1, "B": -1}[action.kind] * (1.0, 100.0)[action.chunk]
        held.append(held[-1] + step)
    assert peak == max(held)
    assert [chunk for _, chunk in backwards] == [a.chunk for a in actions if a.kind == "B"]
    assert all(bytes_held >= (1.0, 100.0)[chunk] for bytes_held, chunk in backwards)
    assert backwards[-1] == ((1.0, 100.0)[actions[-1].chunk], actions[-1].chunk)
    split = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("W", 0, 1)]
    assert chunk_occupancy(split, [1.0, 100.0], "W") == (101.0, [(101.0, 1)])  # W frees


def test_the_planner_proposes_only_schedules_whose_live_memory_it_predicts():
    """ZB-H1, ZB-H2 and interleaved 1F1B are proposed (their live moments are predicted,
    held against the live count in test_planner); recompute not under ZB-H1/ZB-H2 (their
    per-layer recompute is not held against live memory)."""
    layouts = PipelineStrategy.plan_layouts(4, layer_list=True)
    assert {"stages": 2, "micro_batches": 4} in layouts
    assert {"stages": 2, "micro_batches": 4, "schedule": "gpipe"} in layouts
    assert {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"} in layouts
    assert {"stages": 4, "micro_batches": 8, "schedule": "zb-h2"} in layouts
    assert not any(x.get("recompute") and x.get("schedule", "").startswith("zb") for x in layouts)
    assert {"stages": 2, "micro_batches": 4, "virtual_stages": 2} in layouts
    assert {"stages": 2, "micro_batches": 8, "virtual_stages": 2, "recompute": True} in layouts
    assert not any(x.get("virtual_stages") and x.get("schedule") for x in layouts)


def test_the_planner_drops_layouts_that_cut_more_pieces_than_the_model_has_layers():
    """Interleaving cuts stages x virtual stages pieces: 2 x 2 needs 4 layers."""

    def proposed(depth: int) -> list[dict]:
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(depth)))
        found = candidates(
            model,
            devices=2,
            global_batch=8,
            strategies=["pipeline"],
            accumulations=[1],
            precisions=["fp32"],
            fixed={},
        )
        return [c.options for c in found]

    assert not any(o.get("virtual_stages") for o in proposed(3))
    assert {"stages": 2, "micro_batches": 4, "virtual_stages": 2} in proposed(4)


def _ideal_run(tmp_path, schedule: str, stages: int, micro: int, chunks: int = 1):
    """Three steps of ``schedule`` played by the simulator, 1 ms per tick (F 1, B 1, W 1;
    an unsplit backward 2), written as the engine writes its timeline."""
    actions = build_schedule(schedule, stages, micro, chunks)
    placed = simulate(actions, forward_ticks=1, backward_ticks=2, weight_ticks=1)
    meta = {"kind": "meta", "stages": stages, "micro_batches": micro, "schedule": schedule}
    records = [{**meta, "replicas": 1, **({"virtual_stages": chunks} if chunks > 1 else {})}]
    for step in range(3):
        for stage, slots in enumerate(placed):
            records += [
                {
                    "kind": KINDS[slot.action.kind],
                    "rank": stage,
                    "stage": stage,
                    "replica": 0,
                    "step": step,
                    "micro": slot.action.micro,
                    "start": step + slot.start * 1e-3,
                    "end": step + slot.end * 1e-3,
                }
                for slot in slots
            ]
    run = tmp_path / schedule
    run.mkdir()
    (run / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.mark.parametrize(
    ("schedule", "stages", "micro", "chunks"),
    [
        ("1f1b", 2, 4, 1),
        ("1f1b", 2, 4, 2),
        ("1f1b", 4, 8, 2),
        ("zb-h1", 2, 4, 1),
        ("zb-h1", 4, 8, 1),
    ],
)
def test_an_ideal_run_measures_its_schedules_theory(tmp_path, schedule, stages, micro, chunks):
    run = _ideal_run(tmp_path, schedule, stages, micro, chunks)
    timeline = read_timeline(run / "timeline.jsonl")
    theory, _ = timeline.theory()
    assert measured_bubble(timeline, step=1) == pytest.approx(theory, abs=1e-12)
    text = summarize(run)
    assert "measured/theory     1.00" in text


def test_the_report_times_w_apart(tmp_path):
    text = summarize(_ideal_run(tmp_path, "zb-h1", 2, 4))
    assert "theoretical bubble  7.7%  = (p-1)(F+B-W)/(m(F+B+W)+...)" in text
    assert "W ms/micro" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    # the first stage, fed data: B empty, W its whole backward (``stage_ticks``)
    assert [row[3:6] for row in rows] == [["1.000", "0.000", "2.000"], ["1.000", "1.000", "1.000"]]


def test_the_planner_prices_steps_back_to_back_where_nothing_ends_them_together():
    """2 stages, 4 micro-batches of ZB-H1 on the unit clock (F = B = W = 1 tick, the
    first stage's backward 2), each stage's optimizer step 0.5: flushed, a step is its
    round's span (3m + p - 1 = 13) and the slowest optimizer step; back to back, the
    last stage's last W passes run while the first stage starts the next step, and a
    step takes 12 ticks and that stage's own optimizer step, 12.5, idling only for it:
    the bubble the plan's note gives, a wait for another stage, is none."""
    flushed = build_schedule("zb-h1", 2, 4)
    ahead = build_schedule("zb-h1", 2, 4, flush=False)
    passes = [[(1.0, 0.0, 2.0)], [(1.0, 1.0, 1.0)]]
    span, _ = placed_round(flushed, passes, 0.0)
    assert span + 0.5 == 13.5
    step, idle = placed_steps(ahead, passes, 0.0, rounds=1, optimizer_s=[0.5, 0.5])
    assert (step, idle) == (12.5, 0.0)  # the last stage waits for nothing
    step, _ = placed_steps(ahead, passes, 0.0, rounds=2, optimizer_s=[0.5, 0.5])
    assert step == 24.5  # two rounds a step: one optimizer step between steps


def test_a_tie_across_stages_makes_the_planner_price_the_flushed_lists():
    """As the engine, which runs ZB-H1's flushed lists where a tied Parameter's gradient
    is summed across stages at each step's end."""
    tied = SimpleNamespace(tied_layers=((0, 3),))
    assert _ties_span_stages(tied, [(0, 2), (2, 4)], 2)  # layers 0 and 3: stages 0 and 1
    assert _ties_span_stages(tied, [(0, 1), (1, 3), (3, 4)], 3)  # stages 0 and 2
    same = SimpleNamespace(tied_layers=((0, 1),))
    assert not _ties_span_stages(same, [(0, 2), (2, 4)], 2)  # both on stage 0
    # interleaved, 2 stages x 2 chunks: piece j on stage j % 2
    pieces = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert _ties_span_stages(tied, pieces, 2)  # pieces 0 and 3: stages 0 and 1
    assert not _ties_span_stages(SimpleNamespace(tied_layers=((0, 2),)), pieces, 2)


def test_the_measured_costs_name_the_layers_a_tied_parameter_spans():
    embed, head, middle = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False), nn.Linear(4, 4)
    head.weight = embed.weight
    model = nn.Sequential(embed, middle, nn.ReLU(), head)
    cut = _Cut.of(model, True, False, torch.device("cpu"))
    assert _tied_layers(model, cut) == ((0, 3),)
    untied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert _tied_layers(untied, _Cut.of(untied, True, False, torch.device("cpu"))) == ()


def test_the_planner_prices_the_flushed_lists_where_the_engine_runs_them():
    """As ``PipelineEngine._step_ends_together``: fp16's vote, a tensor split or a tie
    across stages; else the lists for steps back to back."""
    untied, tied = SimpleNamespace(tied_layers=()), SimpleNamespace(tied_layers=((0, 3),))
    halves = [(0, 2), (2, 4)]
    fp32, fp16 = Run(devices=2, global_batch=8), Run(devices=2, global_batch=8, precision="fp16")
    plain, split = Layout.over(2, stages=2), Layout.over(4, stages=2, tensor=2)
    assert not _steps_end_together(fp32, plain, untied, halves)
    assert _steps_end_together(fp16, plain, untied, halves)
    assert _steps_end_together(fp32, split, untied, halves)
    assert _steps_end_together(fp32, plain, tied, halves)
