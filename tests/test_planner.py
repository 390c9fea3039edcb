"""The planner: ranking on synthetic predictions with known answers, each strategy's
arithmetic against the live memory its engine holds, and plan / predict / auto end to end.

Memory bar: the issue asks for predicted peaks within 10% of the measured ones
(``ACCURACY``) and never more than 5% under (``UNDER``), measured by an independent count
of live storages (``runtime/live_tensors``), not by the ledger the prediction books; the
10% is the contract the planner states (and its ``MARGIN``), not a figure tuned to pass.
Step times are measured, noisy and machine-dependent (``bench_planner.py`` reports their
ranking): one test holds the chosen plan's and the runner-up's within a wide factor
(``STEP_TIME_FACTOR``) of measured, on a model where the optimizer matters.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.cost_model import (
    Curve,
    Line,
    MachineCosts,
    Prediction,
    Run,
    ledger_at_peak,
)
from paratrain.parallel.layout import Layout
from paratrain.parallel.pipeline import cost as pipeline_cost
from paratrain.parallel.pipeline.cost import chunk_passes, in_flight
from paratrain.planner import api, measure
from paratrain.planner.api import candidates
from paratrain.planner.choose import MARGIN, Candidate, NoPlanFits, rank
from paratrain.planner.machine import cores
from paratrain.planner.measure import measure_model, measure_optimizer
from tests import planner_workers as pw

ACCURACY = 0.10


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test measures afresh: what an earlier plan measured is kept per machine
    (``cost_cache``), and a test that counts measurements must not find it."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))


def _candidate(strategy: str, peak: int, step_s: float, **options) -> Candidate:
    memory = dict.fromkeys(("parameters", "gradients", "optimizer", "activations"), 0)
    memory["parameters"] = peak
    return Candidate(strategy, options, prediction=Prediction(memory=memory, step_s=step_s))


# ------------------------------------------------------------------ pure ranking


def test_the_fastest_candidate_that_fits_with_the_margin_is_chosen():
    budget = 1000
    found = [
        _candidate("dp", 950, 1.0),  # fits bare, not with the 10% margin
        _candidate("zero2", 800, 1.5),
        _candidate("zero3", 500, 2.0),
        _candidate("pipeline", 400, 1.2, stages=2),
    ]
    chosen = rank(found, budget, devices=4)
    assert chosen.strategy == "pipeline"
    verdicts = {c.strategy: c.verdict for c in found}
    assert verdicts["dp"] == "over budget: needs 950 B (+10%: 1.02 KiB) > 1000 B"
    assert verdicts["zero2"] == "fits; 1.25x the chosen step time"
    assert verdicts["pipeline"] == "chosen"
    assert 950 * (1 + MARGIN) > budget >= 800 * (1 + MARGIN)


def test_without_a_budget_the_fastest_wins_and_a_tie_goes_to_the_smaller_peak():
    found = [_candidate("dp", 900, 1.0), _candidate("zero1", 700, 1.0)]
    assert rank(found, None, devices=2).strategy == "zero1"


def test_a_budget_nothing_fits_names_the_smallest_need():
    found = [_candidate("dp", 900, 1.0), _candidate("zero3", 300, 3.0)]
    with pytest.raises(NoPlanFits) as caught:
        rank(found, 200, devices=4)
    message = str(caught.value)
    assert message.startswith("no plan fits 200 B per worker: the smallest, zero3 on 4x1x1")
    assert "needs 300 B per worker (330 B with the 10% margin)" in message
    assert caught.value.smallest.strategy == "zero3"


def test_the_ledger_peaks_at_the_larger_of_forward_and_step_end():
    kept = ledger_at_peak(
        parameters=10, gradients=10, optimizer=20, activations=5, gradients_persist=True
    )
    assert sum(kept.values()) == 45
    dropped = ledger_at_peak(
        parameters=10, gradients=10, optimizer=20, activations=5, gradients_persist=False
    )
    assert dropped["activations"] == 0 and sum(dropped.values()) == 40  # the step's end
    big = ledger_at_peak(
        parameters=10, gradients=10, optimizer=20, activations=50, gradients_persist=False
    )
    assert big["gradients"] == 0 and sum(big.values()) == 80  # the forward


def test_schedules_hold_their_micro_batches():
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, s, 8) for s in range(4)] == [8, 8, 8, 8]
    assert in_flight("1f1b", 4, 0, 2) == 2


def _mlp_costs():
    """The mlp's measured costs at 8 samples under Adam, one tensor rank."""
    return measure_model(
        pw.model("mlp"),
        pw.batch("mlp", 8),
        loss_fn=pw.loss("mlp"),
        optimizer=measure_optimizer(pw.adam),
        tensor=1,
    )


def test_a_message_costs_the_step_where_the_schedules_lists_wait_for_it():
    """The round is the schedule's own lists placed on the stages' passes, each message
    between workers a hop: with 10 ms hops and passes of microseconds, the step grows by
    the hops on its critical path. GPipe's are its fill and drain whatever m; 1F1B's
    steady state at 2 stages is a loop of a hop up and a hop down per 2 micro-batches;
    interleaving crosses between the workers at every chunk (more); ZB-H1 and ZB-H2 wait
    for the same messages as 1F1B, their W passes filling the waits (no more)."""
    costs = dataclasses.replace(pw.flat_times(_mlp_costs(), 1e-6), pass_s=0.0)
    lines = {2: Line(1e-3, 1e-9)}
    quiet = MachineCosts(cores=8, backend="gloo", all_reduce=lines, send=Line.zero())
    slow = dataclasses.replace(quiet, send=Line(0.01, 0.0))  # 10 ms a hop, no bytes' cost
    layout, run = Layout.over(2, stages=2), Run(devices=2, global_batch=8)

    def added(schedule: str, micro: int, chunks: int = 1) -> float:
        options = {"micro_batches": micro, "schedule": schedule, "virtual_stages": chunks}
        fast, waiting = (
            pipeline_cost.predict(costs, costs, m, run, options, layout=layout).step_s
            for m in (quiet, slow)
        )
        return waiting - fast

    # a round's passes are 8 layers x 1 us x m x 2 stages at most (under 0.2 ms at m = 8):
    # what a different critical path adds or skips of them stays under that
    passes = 2e-4
    for micro in (4, 8):
        assert added("gpipe", micro) == pytest.approx(2 * 0.01, abs=passes)
        one_f_one_b = added("1f1b", micro)
        assert one_f_one_b == pytest.approx(micro * 0.01, abs=passes)
        assert added("1f1b", micro, chunks=2) > one_f_one_b + 0.01
        for zero_bubble in ("zb-h1", "zb-h2"):
            assert added(zero_bubble, micro) <= one_f_one_b + passes


def test_a_stages_micro_batch_is_shared_out_as_its_chunks_passes():
    """Each chunk's share of the stage's micro-batch follows its layers' time, within it
    the forward's share; a split backward halves the rest into B and W, and the first
    stage of a zero-bubble pipeline (fed data) runs it all as W."""
    costs = pw.flat_times(_mlp_costs(), 0.3)  # every layer 0.3 s, its forward 0.1 s
    pieces = [(0, 1), (1, 4)]  # a chunk of one layer and one of three

    def flat(per_micro: float, split: bool, deferred: bool, chunks=pieces) -> list[float]:
        passes = chunk_passes(costs, 8.0, chunks, per_micro, split=split, deferred=deferred)
        return [seconds for chunk in passes for seconds in chunk]

    # the stage's 1.2 s (its layers' lines alone) shared 1 : 3, a third of each its forward
    assert flat(1.2, False, False) == pytest.approx([0.1, 0.2, 0.0, 0.3, 0.6, 0.0])
    assert flat(1.2, True, False) == pytest.approx([0.1, 0.1, 0.1, 0.3, 0.3, 0.3])
    assert flat(0.3, True, True, pieces[:1]) == pytest.approx([0.1, 0.0, 0.2])
    # 0.4 s more than the lines (a recompute's rerun, the runner): the backward pays it
    assert flat(1.6, False, False) == pytest.approx([0.1, 0.3, 0.0, 0.3, 0.9, 0.0])


def test_a_stage_pays_its_passes_fixed_cost_once_per_pass_of_each_micro_batch():
    costs = _mlp_costs()
    assert 0 < costs.pass_s < costs.time(8)  # measured, and less than a whole pass pair
    costs = pw.flat_times(costs, 1e-4)  # known layer times: which bound holds is known
    # one core: the step is every stage's work added up, so the passes' cost is exact
    lines = {2: Line(1e-3, 1e-9)}
    machine = MachineCosts(cores=1, backend="gloo", all_reduce=lines, send=Line.zero())
    fixed = 0.01  # 10 ms a pass, far above the measured layers' times
    paying, free = dataclasses.replace(costs, pass_s=fixed), dataclasses.replace(costs, pass_s=0)
    run = Run(devices=2, global_batch=16)
    # (schedule, virtual stages, passes per micro-batch on each stage): F and B per chunk,
    # B split into B and W for zero-bubble, but for the first stage, fed data, whose B does
    # nothing and whose W is its one backward (``LayerTape``)
    schedules = (("gpipe", 1, (2, 2)), ("1f1b", 1, (2, 2)), ("zb-h1", 1, (2, 3)))
    layout = Layout.over(2, stages=2)
    for schedule, chunks, passes in (*schedules, ("zb-h2", 1, (2, 3)), ("1f1b", 2, (4, 4))):
        for micro in (4, 8):
            options = {"micro_batches": micro, "schedule": schedule, "virtual_stages": chunks}
            more, less = (
                pipeline_cost.predict(c, c, machine, run, options, layout=layout).step_s
                for c in (paying, free)
            )
            # 2 stages x m micro-batches x passes, less the whole model's own pair (its
            # layers' lines hold it); float sums of the same terms: equal to rounding
            expected = micro * fixed * (sum(passes) - 2)
            assert more - less == pytest.approx(expected, rel=1e-9), (schedule, micro)
    whole = pipeline_cost.pass_overhead(paying, 8.0, list(range(len(costs.layers))), 2)
    assert whole == pytest.approx(0.0, abs=1e-12)  # one stage is the whole model: no more


def test_a_stage_pays_the_runners_measured_seconds_once_per_micro_batch_and_chunk():
    """``runner_probe``'s figure (messages, waits and bookkeeping per micro-batch) is
    charged like a pass: on one core the step is every stage's work added up, so each
    stage's m micro-batches of each chunk pay it once."""
    costs = pw.flat_times(_mlp_costs(), 1e-4)
    lines = {2: Line(1e-3, 1e-9)}
    plain = MachineCosts(cores=1, backend="gloo", all_reduce=lines, send=Line.zero())
    figure = 0.01
    charged = dataclasses.replace(
        plain, figures={"pipeline": {pipeline_cost.MICRO_BATCH_FIGURE: figure}}
    )
    run, layout = Run(devices=2, global_batch=16), Layout.over(2, stages=2)
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("1f1b", 2)):
        for micro in (4, 8):
            options = {"micro_batches": micro, "schedule": schedule, "virtual_stages": chunks}
            more, less = (
                pipeline_cost.predict(costs, costs, m, run, options, layout=layout).step_s
                for m in (charged, plain)
            )
            # 2 stages x m micro-batches x chunks; float sums of the same terms
            assert more - less == pytest.approx(2 * micro * chunks * figure, rel=1e-9)


def test_the_pipeline_runners_seconds_per_micro_batch_are_measured_and_cached():
    from paratrain.parallel.pipeline import runner_probe
    from paratrain.planner import machine

    figures = paratrain.launch(runner_probe.micro_batch_seconds, devices=2)
    assert figures[0] == figures[1]  # every worker gets the slowest one's figure
    figure = figures[0]["gpipe"]
    assert figure > 0
    measured = dataclasses.replace(
        pw.machine(), figures={"pipeline": {pipeline_cost.MICRO_BATCH_FIGURE: figure}}
    )
    again = machine.from_json(machine.to_json(measured))
    assert again == measured
    assert again.figure("pipeline", pipeline_cost.MICRO_BATCH_FIGURE) == figure
    assert pw.machine().figure("pipeline", pipeline_cost.MICRO_BATCH_FIGURE) == 0.0


def test_a_curve_joins_its_sizes_and_extends_its_end_segments():
    curve = Curve.through({8: 5.0, 16: 6.0, 32: 7.0, 64: 11.0})
    assert [curve.at(x) for x in (8, 12, 32, 48)] == [5.0, 5.5, 7.0, 9.0]
    assert curve.at(4) == 4.5 and curve.at(128) == 19.0  # the end segments extended
    assert Curve.through({8: 2.0}).at(100) == 2.0


def test_the_whole_model_is_timed_at_each_size_accumulating_and_small_sizes_more_often(
    monkeypatch,
):
    """As an engine's micro-batch runs it: into gradient buffers that exist; a size of
    1/k of the largest timed k times as often while its runs are short (each after one
    untimed run); the model's gradients as they were afterwards."""
    from paratrain.parallel.precision import Precision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    sizes, accumulating = [], []

    def loss_fn(outputs, targets):
        sizes.append(outputs.shape[0])
        accumulating.append(all(p.grad is not None for p in model.parameters()))
        return ((outputs - targets) ** 2).mean()

    sample = (torch.randn(8, 4), torch.randn(8, 4))
    autocast = Precision.of("fp32").autocast
    seconds = measure._training_seconds(model, sample, [2, 4, 8], loss_fn, autocast, 3)
    assert set(seconds) == {2, 4, 8} and all(s > 0 for s in seconds.values())
    assert {n: sizes.count(n) for n in (2, 4, 8)} == {8: 1 + 3, 4: 1 + 6, 2: 1 + 12}
    assert all(accumulating)
    assert all(p.grad is None for p in model.parameters())
    # runs too long for TIMED_SECONDS: every size its ``repeats`` only
    sizes.clear()
    monkeypatch.setattr(measure, "TIMED_SECONDS", 0.0)
    measure._training_seconds(model, sample, [2, 4, 8], loss_fn, autocast, 3)
    assert {n: sizes.count(n) for n in (2, 4, 8)} == {8: 1 + 3, 4: 1 + 3, 2: 1 + 3}


def test_a_layers_time_at_small_micro_batches_is_the_measured_not_a_line(monkeypatch):
    """The whole model's times at the four sizes (here made up, no line through them)
    are what the layers add up to at each size."""
    made_up = {8: 10.0, 4: 6.0, 2: 5.0, 1: 4.5}
    monkeypatch.setattr(measure, "_training_seconds", lambda model, sample, sizes, *rest: made_up)
    costs = measure_model(
        pw.model("mlp"),
        pw.batch("mlp", 8),
        loss_fn=pw.loss("mlp"),
        optimizer=measure_optimizer(pw.adam),
        tensor=1,
    )
    for size, seconds in made_up.items():
        assert costs.time(size) == pytest.approx(seconds, rel=1e-12)  # shares sum to 1
    assert costs.time(3) == pytest.approx(5.5, rel=1e-12)
    assert 0 < costs.forward_time(1) < costs.time(1)


def test_a_messages_line_never_falls_with_its_bytes():
    from paratrain.planner.machine import SIZES, _rising

    assert _rising(Line(1e-3, 1e-9)) == Line(1e-3, 1e-9)
    small = Line(2e-3, -1e-10).at(SIZES[0])  # the large payload's fastest run came out lower
    assert _rising(Line(2e-3, -1e-10)) == Line(small, 0.0)


def test_a_line_is_fitted_through_two_sizes():
    line = Line.through((2, 30.0), (8, 90.0))
    assert (line.intercept, line.slope) == (10.0, 10.0) and line.at(4) == 50.0


# ------------------------------------------------------------------ candidates


def test_invalid_layouts_are_never_proposed_and_fixed_options_restrict():
    model = pw.model("gpt")
    common = {"strategies": ("dp", "zero1", "pipeline", "tp"), "precisions": ("fp32",)}
    found = candidates(model, devices=6, global_batch=12, accumulations=(1,), fixed={}, **common)
    for c in found:  # 6 workers: stages x tensor must divide 6; 12 samples must split
        stages, tensor = c.options.get("stages", 1), c.options.get("tensor", 1)
        assert 6 % (stages * tensor) == 0, c
    assert {c.options.get("stages") for c in found if c.strategy == "pipeline"} <= {2, 3}
    fixed = candidates(
        model, devices=4, global_batch=16, accumulations=(1,), fixed={"stages": 2}, **common
    )
    assert fixed and {c.strategy for c in fixed} == {"pipeline"}
    assert all(c.options["stages"] == 2 for c in fixed)


def test_the_optimizer_step_is_timed_with_the_threads_a_worker_gets():
    """With the planning process on more threads than a worker (its own default: every
    core), the optimizer probe once ran on the planner's threads and, on a busy machine,
    predicted a step hundreds of times too long (issue 24)."""
    seen: list[int] = []

    def adam_that_notes_threads(params):
        optimizer = torch.optim.Adam(params, lr=1e-3)
        optimizer.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        return optimizer

    devices = 2
    worker = max(1, cores() // devices)
    with measure.threads(worker + 3):  # the planner's own, unlike any worker's
        paratrain.predict(
            pw.model("mlp"),
            strategy="dp",
            devices=devices,
            global_batch=8,
            optimizer=adam_that_notes_threads,
            loss_fn=pw.loss("mlp"),
            sample=pw.batch("mlp", 8),
            machine=pw.machine(),
        )
    assert seen and set(seen) == {worker}, seen


def test_the_optimizer_is_read_not_assumed():
    adam = measure_optimizer(lambda p: torch.optim.Adam(p, lr=1e-3))
    assert (adam.bytes_per_element, adam.bytes_per_tensor) == (8.0, 4.0)
    sgd = measure_optimizer(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert (sgd.bytes_per_element, sgd.bytes_per_tensor) == (4.0, 0.0)
    plain = measure_optimizer(lambda p: torch.optim.SGD(p, lr=0.1))
    assert (plain.bytes_per_element, plain.bytes_per_tensor) == (0.0, 0.0)


# ------------------------------------------------------------------ against live memory
#
# Held against an independent count of live storages (``LiveTensors``: every storage an
# operator made, at every instant), not against the ledger the engines book: a device
# runs out of the former. Bounds: the planner's stated accuracy above (10%), and never
# more than UNDER below (a plan that fits on paper must fit on the device).

UNDER = 0.05


def _predicted(kind: str, strategy: str, options: dict, devices: int, global_batch: int):
    fixed = dict(options)
    precision = fixed.pop("precision", "fp32")
    return paratrain.predict(
        pw.model(kind),
        strategy=strategy,
        devices=devices,
        global_batch=global_batch,
        optimizer=pw.adam,
        loss_fn=pw.loss(kind),
        sample=pw.batch(kind, global_batch),
        precision=precision,
        machine=pw.machine(),
        **fixed,
    )


def _holds(plan, live: int, what: str) -> None:
    error = plan.predicted_peak_bytes / live - 1
    assert -UNDER <= error <= ACCURACY, f"{what}: predicted {error:+.2%} against live"


ONE_PROCESS = [
    ("mlp", {}),
    ("gpt", {}),
    ("gpt", {"recompute": True}),
    # 2 MiB of logits against 0.1 MiB a block: the peak is the loss's backward (the
    # log-probabilities, their gradient and the logits' gradient at once), no layer's.
    # Found on a GPU (the planner 10-27% under the allocator); here, before the loss's own
    # peak was measured (``live_cost.backward_peak``) and the single engine stopped
    # holding the logits through backward: -29.6% and -30.7% (dp below: -6.6%; zero3's
    # peak is elsewhere, -0.1% before and after); after, each within 0.1% under
    ("gpt-vocab", {}),
    ("gpt-vocab", {"recompute": True}),
]


def test_one_process_predictions_cover_the_live_peak():
    """The single engine, with and without recompute (whose rebuilt segment the ledger
    never sees): the prediction against the live count."""
    layouts = [(kind, "single", options) for kind, options in ONE_PROCESS]
    live = pw.live_peaks(layouts, 8)
    for (kind, _, options), peak in zip(layouts, live, strict=True):
        _holds(_predicted(kind, "single", options, 1, 8), peak, f"{kind} {options}")


TWO_WORKERS = [
    ("gpt", "zero3", {}),
    ("gpt", "zero3", {"recompute": True}),
    ("gpt-vocab", "dp", {}),
    ("gpt-vocab", "zero3", {}),
    ("mlp", "pipeline", {"stages": 2, "micro_batches": 4}),
    # B keeps each layer's output gradient and the whole forward's graph until W
    # (``pipeline/split_cost``): 697,036 B live, 560,820 predicted without them, 671,556 with
    ("gpt", "pipeline", {"stages": 2, "micro_batches": 2, "schedule": "zb-h1"}),
    # interleaved 1F1B, proposed by the planner since each chunk is counted on its own
    # (``pipeline/chunk_cost``): counted over both chunks at once, a recomputed backward
    # was +13.5% here (9.11 MB predicted then, 8.65 MB now, 8.03 MB live); counted as
    # halves of a stage, the 2-block gpt's embedding chunk was priced as a block (+13.0%,
    # now +8.3%: 549,692 B against 507,580)
    ("mlp", "pipeline", {"stages": 2, "micro_batches": 4, "virtual_stages": 2}),
    ("gpt", "pipeline", {"stages": 2, "micro_batches": 4, "virtual_stages": 2}),
    ("gpt-wide", "pipeline", {"stages": 2, "micro_batches": 4, "virtual_stages": 2}),
    (
        "gpt-wide",
        "pipeline",
        {"stages": 2, "micro_batches": 4, "virtual_stages": 2, "recompute": True},
    ),
]


def test_zero3_and_pipeline_predictions_cover_the_live_peak_of_two_workers():
    """ZeRO-3's gathered units and flattened gradients, its recompute, and a pipeline
    stage's micro-batches in flight: what the ledger leaves out, held on two workers."""
    live = paratrain.launch(pw.live_peaks, devices=2, args=(TWO_WORKERS, 8))[0]
    for (kind, strategy, options), peak in zip(TWO_WORKERS, live, strict=True):
        plan = _predicted(kind, strategy, options, 2, 8)
        _holds(plan, peak, f"{kind} {strategy} {options}")


LAYOUTS = [
    ("mlp", "dp", {}),
    ("mlp", "zero2", {"recompute": True}),
    ("gpt", "zero3", {}),
    ("gpt", "pipeline", {"stages": 2, "micro_batches": 4, "schedule": "gpipe"}),
    ("gpt", "dp", {"tensor": 2, "precision": "bf16"}),
    # on the 2-block 32-wide gpt this layout's live peak fell 9% (287,820 to 262,332 B) once
    # flattening a stage's activations left no reference cycle holding them, and its
    # prediction, unchanged, is 14% over it; on this 4-block 128-wide one +8.75%
    ("gpt-wide", "pipeline", {"stages": 2, "tensor": 2, "micro_batches": 2, "recompute": True}),
    # its live peak is bimodal (401,016 or 414,200 bytes on this machine, 1 run in 6 the
    # latter): gloo's worker thread sometimes still holds the last forward all-reduce's
    # buffer through the loss's backward, which the prediction now counts
    # (``live_cost.collective_lag``): 404,588 predicted, +0.9% and -2.3%
    ("gpt", "tp", {"tensor": 4}),
]


@pytest.mark.slow
def test_predicted_peaks_cover_the_live_peaks_of_four_workers():
    global_batch = 8
    live = paratrain.launch(pw.live_peaks, devices=4, args=(LAYOUTS, global_batch))[0]
    for (kind, strategy, options), peak in zip(LAYOUTS, live, strict=True):
        _holds(_predicted(kind, strategy, options, 4, global_batch), peak, f"{kind} {strategy}")


def test_the_benchmarks_table_covers_every_category_the_issue_lists():
    """``bench_planner.py --part memory`` holds the prediction against the live count on
    every strategy, schedule, stage count, recompute, bf16 and the Hugging Face models."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import planner_memory

    assert planner_memory.missing(planner_memory.CONFIGS) == []
    assert planner_memory.missing(planner_memory.CONFIGS[:3]) != []


class _NoLayerList(nn.Module):
    """The test gpt behind a forward of its own (as a Hugging Face model is): measured as
    one layer fed token ids, so with its parameters' gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(pw.model("gpt"))

    def forward(self, x):
        for layer in self.inner:
            x = layer(x)
        return x


def test_a_whole_model_measured_at_small_sizes_peaks_as_at_the_runs_size():
    """Measured at 1 and 2 samples (a slow model on a busy machine) or at 4 and 8, the
    whole model's backward peak at 8 and 16 samples is the same to the byte: each stretch
    between two gradients' arrivals is a line in the samples (the allocations are), and
    the peak is their highest (``Envelope``). The one line through the two small sizes'
    peaks, which the planner used before, reads the gradients' moment and comes out low."""
    optimizer = measure_optimizer(pw.adam)
    model, sample = _NoLayerList(), pw.batch("gpt", 8)
    small, large = (
        measure_model(
            model, sample, loss_fn=pw.loss("gpt"), optimizer=optimizer, tensor=1, samples=samples
        )
        .layers[0]
        .transient
        for samples in (2, 8)
    )
    assert len(small.lines) > 1
    assert [small.at(n) for n in (8, 16)] == [large.at(n) for n in (8, 16)]
    one_line = Line.through((1, small.at(1)), (2, small.at(2)))
    assert one_line.at(8) < 0.95 * large.at(8)


# ------------------------------------------------------------------ plan and auto


def test_plan_returns_what_setup_takes_and_a_table_of_every_candidate():
    plan = paratrain.plan(
        pw.model("gpt"),
        devices=4,
        global_batch=8,
        memory_per_device="4MiB",
        optimizer=pw.adam,
        loss_fn=pw.loss("gpt"),
        sample=pw.batch("gpt", 8),
        machine=pw.machine(),
    )
    assert plan.predicted_peak_bytes * (1 + MARGIN) <= 4 * 2**20
    assert set(plan.predicted_memory) == {
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "communication",
        "transient",
    }
    assert plan.predicted_step_s > 0
    assert plan.options["precision"] == "fp32" and "gradient_accumulation" in plan.options
    table = plan.table()
    assert table.splitlines()[2].split()[0] == plan.strategy  # the chosen one first
    assert "chosen" in table and "fits;" in table
    strategies = {c.strategy for c in plan.candidates}
    assert {"dp", "zero1", "zero2", "zero3", "pipeline", "tp"} <= strategies


def test_a_budget_too_small_for_every_plan_says_the_smallest_need():
    with pytest.raises(NoPlanFits, match=r"no plan fits 64 KiB per worker: the smallest, "):
        paratrain.plan(
            pw.model("gpt"),
            devices=2,
            global_batch=8,
            memory_per_device="64KiB",
            optimizer=pw.adam,
            loss_fn=pw.loss("gpt"),
            sample=pw.batch("gpt", 8),
            machine=pw.machine(),
        )


@pytest.mark.slow
def test_setup_auto_plans_in_the_job_and_every_worker_builds_the_same_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))  # measured here, cached there
    results = paratrain.launch(pw.auto_worker, devices=2, args=("3MiB", 8))
    first = results[0]
    assert all(
        r["strategy"] == first["strategy"] and r["options"] == first["options"] for r in results
    )
    assert first["engine"] == first["strategy"]
    assert first["predicted"] * (1 + MARGIN) <= 3 * 2**20
    measured = max(r["measured"] for r in results)
    assert -UNDER <= first["predicted"] / measured - 1 <= ACCURACY
    assert list((tmp_path / "machine").glob("*.json")), "the collectives were not cached"


def test_measurement_leaves_the_model_as_it_was():
    model = pw.model("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generator_state = torch.get_rng_state()
    measure_model(
        model,
        pw.batch("gpt", 8),
        loss_fn=pw.loss("gpt"),
        optimizer=measure_optimizer(pw.adam),
        tensor=2,
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(generator_state, torch.get_rng_state())


# ------------------------------------------------------------------ the command line

PLAN_FLAGS = ["--model", "mlp", "--dataset", "synthetic", "--hidden", "32", "--depth", "2"]
PLAN_FLAGS += ["--devices", "2", "--global-batch", "16"]


@pytest.mark.slow
def test_the_plan_command_prints_the_choice_every_candidate_and_the_train_flags(
    tmp_path, monkeypatch, capsys
):
    from paratrain.cli import main

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    assert main(["plan", *PLAN_FLAGS, "--memory-per-device", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: strategy ")
    assert "predicted: " in out and " peak per worker (" in out
    assert "strategy  mesh" in out and "chosen" in out
    flags = out.strip().splitlines()[-1]
    assert flags.startswith("to train with it: paratrain train --model mlp --dataset synthetic")
    assert main(["plan", *PLAN_FLAGS, "--memory-per-device", "1KiB"]) == 1
    captured = capsys.readouterr()
    assert "over budget" in captured.out
    assert "paratrain: no plan fits 1 KiB per worker: the smallest, " in captured.err


@pytest.mark.slow
def test_train_strategy_auto_says_its_choice_and_the_measured_figures_beside_it(
    tmp_path, monkeypatch, capsys
):
    from paratrain.cli import main

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    args = ["train", "--no-progress", *PLAN_FLAGS, "--strategy", "auto", "--steps", "3"]
    args += ["--run-dir", str(tmp_path / "run"), "--memory-per-device", "2MiB"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "paratrain: plan: strategy " in captured.err
    chosen = captured.err.split("plan: strategy ")[1].split()[0]
    assert f"strategy {chosen}, 2 worker(s)" in captured.out
    assert "  planned           " in captured.out
    line = next(x for x in captured.out.splitlines() if x.startswith("  planned memory    "))
    off = float(line.split("(")[1].split("%")[0])
    # the ledger books part of what is live (not the temporaries), the prediction all of it
    # (held against the live count above): the ledger may be lower, never much higher
    assert off <= 100 * UNDER, line


def test_shared_cores_give_the_work_over_the_cores_or_the_chain_whichever_is_longer():
    machine = pw.machine()  # 8 cores
    assert machine.compute_seconds(total_work_s=4.0, critical_s=1.0) == 1.0  # 4 workers
    assert machine.compute_seconds(total_work_s=16.0, critical_s=1.0) == 2.0  # 16 workers
    # a pipeline's chain of m + p - 1 slots can outlast its work spread over the cores
    assert machine.compute_seconds(total_work_s=8.0, critical_s=3.5) == 3.5


def test_the_machines_figures_survive_their_json_file():
    from paratrain.planner.machine import from_json, to_json

    machine = pw.machine()
    assert from_json(to_json(machine)) == machine
    assert machine.reduce_scatter_s(1e6, 2) == machine.all_reduce_s(1e6, 2)  # none measured
    assert machine.all_reduce_s(1e6, 1) == 0.0  # a group of one sends nothing


def test_a_slow_model_is_measured_at_sizes_one_run_of_which_fits_the_budget(monkeypatch):
    """Doubling from 2 samples, a size is taken while twice its measured run stays within
    SIZE_BUDGET_S; a fast model is measured at the sample's own size."""
    clock = [0.0]
    per_sample = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(measure, "SIZE_BUDGET_S", 2.0)
    ran = []

    def whole_run(size: int) -> None:
        ran.append(size)
        clock[0] += per_sample[0] * size

    per_sample[0] = 0.3  # 2 samples: 0.6 s (x2 = 1.2, within); 4: 1.2 s (x2 = 2.4, over)
    assert measure._affordable_size(whole_run, 64) == 4
    assert ran == [2, 4]
    per_sample[0] = 0.001
    assert measure._affordable_size(whole_run, 64) == 64
    assert measure._affordable_size(whole_run, 3) == 3
    assert measure._affordable_size(whole_run, 1) == 1


# ------------------------------------------------------------------ step time, measured

STEP_TIME_FACTOR = 3.0
"""How far a predicted step time may be from the measured one, either way. The prediction
adds per-layer compute timed alone (scaled to the whole model's), the optimizer's step
from a probe, each the fastest of its runs, and collectives and messages measured once
per machine at the lower quartile of 12 repetitions after work (``machine.after_work``:
what a step typically pays them). The measurement is therefore a step's typical cost,
the median of 12 steps (``median_step_seconds``). Against the fastest step, which this
test used while collectives were priced at their fastest, the prediction came out
1.2-2.3x on a quiet 2-core machine (tp 1.7-2.3, a 2-stage pipeline 1.2-1.7; five plans
of two launches each) and 3.2x once in CI (tp predicted 16.0 ms, fastest step 5.0 ms:
its collectives priced from one slow launch, ``machine.middle_launch``). Against the
median of 8 steps: 1.2-1.7 (tp) and 1.0-1.6 (pipeline) in those launches; with the
collectives from the middle of three launches, 0.88-1.70 and 0.93-1.56 (three plans).
Under 2x, so 3x, both ways. The errors it is here to catch are ten times wider: the
optimizer probe timed with the planning process's threads (a phantom 330 ms on steps of
~1-10 ms: ratio over 30), and a pipeline's messages timed with the receiver busy (a
2-stage pipeline predicted at 4.7 ms, its median step 237 ms at load 19: ratio 0.02).
The median moves with other processes on the machine (4x between launches at load
17-22 on 2 cores shared with other sessions' tests); CI runs the suite alone."""


def _runner_up(plan) -> Candidate:
    """The fastest predicted candidate of another strategy than the chosen one."""
    others = [
        c
        for c in plan.candidates
        if c.prediction is not None and c.strategy != plan.strategy and c.invalid is None
    ]
    return min(others, key=lambda c: c.prediction.step_s)


@pytest.mark.slow
def test_predicted_step_times_of_the_chosen_and_the_runner_up_are_near_the_measured(
    tmp_path, monkeypatch
):
    """On a model whose optimizer step is a large share of its step, and with the planning
    process on more threads than a worker gets (what a user's own
    ``torch.set_num_threads`` or a many-core machine gives), the predictions hold."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    global_batch, devices = 8, 2
    with measure.threads(4 * cores()):
        plan = paratrain.plan(
            pw.wide(),
            devices=devices,
            global_batch=global_batch,
            optimizer=pw.adamw,
            loss_fn=pw.loss("mlp"),
            sample=pw.wide_batch(global_batch),
            gradient_accumulation=1,
        )
    runner_up = _runner_up(plan)
    for strategy, options, predicted in (
        (plan.strategy, plan.options, plan.predicted_step_s),
        (runner_up.strategy, runner_up.setup_options, runner_up.prediction.step_s),
    ):
        measured = paratrain.launch(
            pw.median_step_seconds, devices=devices, args=(strategy, options, global_batch, 12)
        )[0]
        ratio = predicted / measured
        assert 1 / STEP_TIME_FACTOR <= ratio <= STEP_TIME_FACTOR, (
            f"{strategy} {options}: predicted {predicted:.4f} s, measured {measured:.4f} s"
        )


# ------------------------------------------------------------------ fast answers: the cache


def _counting(monkeypatch) -> dict[str, int]:
    """How many times the model and the optimizer are measured from now on."""
    calls = {"model": 0, "optimizer": 0}
    real_model, real_optimizer = api.measure_model, api.measure_optimizer

    def model(*args, **kwargs):
        calls["model"] += 1
        return real_model(*args, **kwargs)

    def optimizer(*args, **kwargs):
        calls["optimizer"] += 1
        return real_optimizer(*args, **kwargs)

    monkeypatch.setattr(api, "measure_model", model)
    monkeypatch.setattr(api, "measure_optimizer", optimizer)
    return calls


def _plan_gpt(**keywords):
    return paratrain.plan(
        pw.model("gpt"),
        devices=2,
        global_batch=8,
        optimizer=pw.adam,
        loss_fn=pw.loss("gpt"),
        sample=pw.batch("gpt", 8),
        machine=pw.machine(),
        gradient_accumulation=1,
        **keywords,
    )


def test_a_second_plan_measures_nothing_and_refresh_measures_again(monkeypatch):
    calls = _counting(monkeypatch)
    first = _plan_gpt()
    measured = dict(calls)
    assert measured == {"model": 2, "optimizer": 1}  # tensor degrees 1 and 2
    second = _plan_gpt()
    assert calls == measured
    assert second.table() == first.table()  # the same figures, read from the files
    _plan_gpt(refresh=True)
    assert calls == {kind: 2 * count for kind, count in measured.items()}


def test_another_model_loss_or_optimizer_is_measured_not_answered_from_the_file(monkeypatch):
    import functools

    import torch.nn.functional as F

    from paratrain.models import build_model

    calls = _counting(monkeypatch)

    def ask(model, loss_fn=F.cross_entropy, optimizer=pw.adam):
        paratrain.predict(
            model,
            strategy="single",
            devices=1,
            global_batch=8,
            optimizer=optimizer,
            loss_fn=loss_fn,
            sample=pw.batch("mlp", 8),
            machine=pw.machine(),
        )
        return dict(calls)

    assert ask(pw.model("mlp")) == {"model": 1, "optimizer": 1}
    assert ask(pw.model("mlp")) == {"model": 1, "optimizer": 1}
    wider = build_model("mlp", in_features=32, hidden=48, depth=3, classes=10)
    assert ask(wider)["model"] == 2
    smoothed = functools.partial(F.cross_entropy, label_smoothing=0.1)
    assert ask(pw.model("mlp"), loss_fn=smoothed)["model"] == 3
    # another optimizer is probed; the model's figures do not depend on it
    assert ask(pw.model("mlp"), optimizer=pw.adamw) == {"model": 3, "optimizer": 2}


def test_the_machines_collectives_are_measured_once_and_again_on_refresh(tmp_path, monkeypatch):
    import importlib

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))  # not the user's cache

    from paratrain.planner import machine

    launch = importlib.import_module("paratrain.runtime.launch")  # the module, not its function
    launched = []

    def fake_launch(function, devices):
        launched.append(devices)
        return [machine.to_json(pw.machine())]

    monkeypatch.setattr(launch, "launch", fake_launch)
    assert machine.machine_costs(4) == pw.machine()
    assert machine.machine_costs(4) == pw.machine()
    assert launched == [4] * machine.launches(4)
    machine.machine_costs(4, refresh=True)
    assert launched == [4] * (2 * machine.launches(4))


def test_the_middle_launch_by_its_small_all_reduce_is_kept_whole(tmp_path, monkeypatch):
    """A launch whose processes the scheduler placed badly prices every collective several
    times over (1.2-4.4 ms against 0.3-0.7 for a 4 KiB all-reduce on 2 cores); the cached
    figures are the middle launch's, all of them from that one launch, where each worker
    has a core of its own."""
    import importlib

    from paratrain.planner import machine

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "cores", lambda: 4)  # a core for each of the 4 workers
    assert machine.launches(4) == machine.LAUNCHES == 3
    assert machine.launches(5) == 1  # workers time-sliced in any launch: one will do

    def launch_figures(small_s: float, send_s: float) -> MachineCosts:
        lines = {n: Line(small_s, 1e-9) for n in (2, 4)}
        return MachineCosts(cores=8, backend="gloo", all_reduce=lines, send=Line(send_s, 1e-9))

    slow, usual, fast = (
        launch_figures(4e-3, 9e-5),
        launch_figures(6e-4, 1e-4),
        launch_figures(3e-4, 2e-4),
    )
    measured = iter([slow, fast, usual])
    launch = importlib.import_module("paratrain.runtime.launch")
    monkeypatch.setattr(
        launch, "launch", lambda function, devices: [machine.to_json(next(measured))]
    )
    kept = machine.machine_costs(4, refresh=True)
    assert kept == usual  # its send too, though another launch's was faster
    assert machine.middle_launch([machine.to_json(slow)]) == machine.to_json(slow)


def test_each_distinct_block_is_timed_once(monkeypatch):
    """A gpt's blocks share their shapes: one is timed for all, at each of the two sizes."""
    from paratrain.models import build_model
    from paratrain.parallel.layers import layer_list

    timed = []
    real = measure._layer_times

    def counted(layer, *args):
        timed.append(type(layer).__name__)
        return real(layer, *args)

    monkeypatch.setattr(measure, "_layer_times", counted)
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=17, block_size=16, n_layer=3, n_head=4, n_embd=32)
    costs = measure_model(
        model,
        pw.batch("gpt", 8),
        loss_fn=pw.loss("gpt"),
        optimizer=measure_optimizer(pw.adam),
        tensor=1,
    )
    names = [type(layer).__name__ for layer in layer_list(model)[0]]
    assert names == ["Embedding", "Block", "Block", "Block", "LayerNorm", "Linear"]
    assert sorted(timed) == sorted(["Embedding", "Block", "LayerNorm", "Linear"] * 2)
    blocks = {costs.layers[i].time_s for i, name in enumerate(names) if name == "Block"}
    assert len(blocks) == 1


def test_collectives_are_timed_after_each_members_work_as_a_step_meets_them():
    """Back to back, every member is already waiting in the collective and its latency
    comes out a fifth of what a step pays (issue 24: the planner chose tensor parallelism
    on 2 workers, predicted 2.4 ms per step, measured 10.2)."""
    from paratrain.planner.machine import REPEATS, after_work

    events: list[str] = []

    def note(event: str):
        return lambda: events.append(event)

    after_work(note("collective"), note("work"), member=True, line_up=note("line up"))
    assert events == ["line up", "work", "collective"] * (1 + REPEATS)
    events.clear()  # a point-to-point message: the receive posted before the work
    after_work(note("wait"), note("work"), member=True, line_up=note("line up"), post=note("post"))
    assert events == ["line up", "post", "work", "wait"] * (1 + REPEATS)
    events.clear()
    assert after_work(note("collective"), note("work"), member=False, line_up=note("line up")) == 0
    assert events == ["line up"] * (1 + REPEATS)


def test_plan_refresh_flag_reaches_the_planner(monkeypatch):
    from paratrain.cli import main
    from paratrain.run import prepare

    asked = []

    class Stop(Exception):
        pass

    def recorded(config, **keywords):
        asked.append(keywords)
        raise Stop

    monkeypatch.setattr(prepare, "plan_run", recorded)
    for flags, refresh in (([], False), (["--refresh"], True)):
        with pytest.raises(Stop):
            main(["plan", "--model", "mlp", "--dataset", "synthetic", *flags])
        assert asked.pop() == {"refresh": refresh}


def test_the_key_is_the_same_in_another_process():
    """The key names a file another process must find: nothing in it may depend on the
    order of a set or an object's address (two classes called Embedding once swapped
    places between runs, and every plan measured again)."""
    import json
    import os
    import subprocess
    import sys

    from paratrain.planner import cost_cache

    script = (
        "import json; from tests import planner_workers as pw; "
        "from paratrain.planner import cost_cache as c; "
        "print(json.dumps([c.model_fingerprint(pw.model('gpt')), c.fingerprint_of(pw.loss('gpt')),"
        " c.optimizer_fingerprint(pw.adam)], default=str))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    ).stdout
    here = [
        cost_cache.model_fingerprint(pw.model("gpt")),
        cost_cache.fingerprint_of(pw.loss("gpt")),
        cost_cache.optimizer_fingerprint(pw.adam),
    ]
    assert json.loads(out) == json.loads(json.dumps(here, default=str))


def test_a_split_the_model_refuses_is_kept_and_refused_again_from_the_file():
    from paratrain.planner import cost_cache

    calls = []

    def refuse():
        calls.append(1)
        raise ValueError("tensor=8 does not divide 4 heads.")

    for _ in range(2):
        with pytest.raises(ValueError, match="does not divide 4 heads"):
            cost_cache.cached("model", ["a model", 8], False, refuse, dict, dict)
    assert len(calls) == 1


def test_what_other_code_measured_or_refused_is_measured_again(monkeypatch):
    """A refusal cached from a bug once outlived its fix (until ``FORMAT`` moved): the
    key holds a digest of paratrain's source, so other code measures again."""
    from paratrain.planner import cost_cache

    calls = []

    def refuse():
        calls.append(1)
        raise ValueError("a refusal from a bug")

    with pytest.raises(ValueError, match="from a bug"):
        cost_cache.cached("model", ["a model"], False, refuse, dict, dict)
    monkeypatch.setattr(cost_cache, "code_fingerprint", lambda: "fixed code")
    assert cost_cache.cached("model", ["a model"], False, lambda: {"a": 1}, dict, dict) == {"a": 1}
    assert len(calls) == 1


def test_an_interrupted_optimizer_step_does_not_become_the_probes_figure(monkeypatch):
    """Steps another process interrupts take tens of times longer (seen on this 2-core
    machine: 48, 1.4, 0.7, 26, 0.6, 0.4 ... ms for the probe's step); a median of three
    once made 21 ms of one and put a phantom 0.1 s on every step of a 335 k-parameter mlp
    (issue 24). The probe keeps the fastest."""
    clock = [0.0]
    durations = iter([0.048, 0.026, 0.021, 0.0004] + [0.030] * 20)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def interrupted_adam(params):
        optimizer = torch.optim.Adam(params, lr=1e-3)

        def advance(*_):
            clock[0] += next(durations)

        optimizer.register_step_pre_hook(advance)
        return optimizer

    probe = measure_optimizer(interrupted_adam)
    elements = (1 << 16) + 16  # the probe's two parameters
    assert probe.step_s_per_element * elements == pytest.approx(0.0004)
