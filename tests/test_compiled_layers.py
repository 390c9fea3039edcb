"""torch.compile'd models and layers: trained exactly under every pipeline schedule (the
zero-bubble ones included), dp, ZeRO 1-3 and tp; resumed from a checkpoint with compile
turned on or off; and not broken into pieces by the memory ledger's hook.

The defects these guard, each failing before its fix: under ZB-H1 and ZB-H2 a stage of
``torch.compile(layer)`` layers raised at its first B (inductor compiles a region's
backward with donated buffers, which cannot run twice, and B keeps the graph for W:
``pipeline/split_backward_limits``); under ``module.compile()`` dynamo traced the ledger's
saved-tensor hook, breaking the compiled graph at its calls (``runtime/memory``); and a
checkpoint saved with compile on was refused with it off, and the reverse
(``checkpoints/wrapper_names``); ``paratrain.plan`` refused every pipeline of a model
compiled whole and cut at named blocks, dynamo tracing its hooks
(``planner/compiled_models``); and under tp and zero3 a model compiled whole recompiled
a frame every step, dynamo guarding on the engines' hook state (``runtime/untraced``).

Tolerance: the suite's (``TOLERANCE``, 1e-5 relative per parameter). The engines run the
same products as the plain loop; inductor's kernels sum in their own order (about 1e-7
relative per fp32 step, measured 1.3e-7 after 10 Adam steps), as an all-reduce does.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import paratrain
from paratrain.models import loss_for
from paratrain.parallel.pipeline import split_backward_limits
from paratrain.runtime.memory import ActivationMeter
from tests import compiled_workers, tp_workers, user_layers, workers
from tests.test_parity_dp import TOLERANCE, relative_error
from tests.test_pipeline_split_points import plan_pipelines

NO_COMPILER = not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++"))
needs_inductor = pytest.mark.skipif(
    NO_COMPILER, reason="inductor compiles C++ on the CPU: no g++, clang++ or $CXX here"
)

TWO_STAGES = {"stages": 2, "micro_batches": 4}


@pytest.fixture(autouse=True)
def own_inductor_cache(tmp_path, monkeypatch):
    """Inductor's kernels compile into a cache of this test's own (the workers inherit the
    variable): its on-disk cache is not keyed by ``ATEN_CPU_CAPABILITY``, and a kernel
    cached under ``avx2`` then failed to build under ``=default`` ("'at::vec' has not been
    declared"), as the suite's two-ISA check runs them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def plain_loop(kind: str, optimizer: str) -> dict:
    """The uncompiled model, 10 steps of the plain PyTorch loop."""
    model, batches = tp_workers.build(kind), tp_workers.batches(kind)
    return workers.plain_loop_state(model, optimizer, batches, loss_for(kind))


def check(runs: list[tuple[str, str, str, dict]], states: list[dict]) -> None:
    plain = {(kind, optimizer): plain_loop(kind, optimizer) for kind, _, optimizer, _ in runs}
    for (kind, how, optimizer, options), state in zip(runs, states, strict=True):
        error = relative_error(state, plain[kind, optimizer])
        label = f"{kind} compiled {how}, {optimizer}, {options}"
        assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"


@pytest.mark.slow
@needs_inductor
def test_every_schedule_trains_compiled_layers_as_the_plain_loop():
    """1F1B, ZB-H1 and ZB-H2 at 2 stages of 4 micro-batches, on layers compiled by
    inductor both ways, SGD-momentum and Adam, against the uncompiled plain loop. Before
    the fix the wrapped layers failed at ZB-H1's first B with torch's donated-buffer error."""
    runs = [
        ("mlp", how, optimizer, {"strategy": "pipeline", "schedule": schedule, **TWO_STAGES})
        for how in ("wrapped", "in place")
        for schedule in ("1f1b", "zb-h1", "zb-h2")
        for optimizer in ("sgd", "adam")
    ]
    args = (runs, "inductor")
    check(runs, paratrain.launch(compiled_workers.compiled_runs_worker, devices=2, args=args)[0])


@pytest.mark.slow
@needs_inductor
def test_data_and_tensor_parallel_train_a_compiled_model_as_the_plain_loop():
    """dp and ZeRO 1-3 on the mlp compiled whole (SGD-momentum and Adam) or module by
    module (Adam), and tp on the gpt both ways (Adam), 2 workers, against the uncompiled
    plain loop: the engines' hooks (gradient buckets, ZeRO-3's gathering before each
    module, tp's collectives inside autograd functions) and the ledger's run inside or
    around the compiled graphs."""
    runs = [
        ("mlp", how, optimizer, {"strategy": strategy})
        for strategy in ("dp", "zero1", "zero2", "zero3")
        for how, optimizer in (("whole", "sgd"), ("whole", "adam"), ("in place", "adam"))
    ]
    runs += [("gpt", how, "adam", {"strategy": "tp"}) for how in ("whole", "in place")]
    args = (runs, "inductor")
    check(runs, paratrain.launch(compiled_workers.compiled_runs_worker, devices=2, args=args)[0])


@pytest.mark.slow
def test_the_planner_prices_the_pipelines_of_a_model_compiled_whole(tmp_path, monkeypatch):
    """``paratrain.plan`` of a model cut at named blocks and compiled whole (backend
    "eager": the failure was dynamo's tracing of the planner's hooks, before any backend)
    prices every pipeline layout, and the plan it chooses, given to ``setup`` with the
    compiled model, trains as the uncompiled plain loop (Adam, 10 steps). Before, every
    candidate was refused ("split point '_orig_mod.body.1' receives other tensors on stage
    1 than the previous stage sent") and ``plan`` raised."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))  # measured here
    torch._dynamo.reset()
    compiled = torch.compile(user_layers.build("wrapped"), backend="eager")
    plan = plan_pipelines(compiled)
    torch._dynamo.utils.counters.clear()
    compiled(tp_workers.batches("mlp")[0][0])  # compiles still (dynamo off would skip it)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    options = {"strategy": plan.strategy, **plan.options}
    state = paratrain.launch(compiled_workers.planned_run_worker, devices=2, args=(options,))[0]
    plain = workers.plain_loop_state(
        user_layers.build("wrapped"), "adam", tp_workers.batches("mlp"), loss_for("mlp")
    )
    error = relative_error(state, plain)
    assert error <= TOLERANCE, f"{options}: relative error {error:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind, strategy", [("gpt", "tp"), ("mlp", "zero3")])
def test_the_engines_hooks_leave_a_compiled_models_graphs_compiled_once(kind, strategy):
    """A model compiled whole, 10 steps under tp (collectives inside its layers' autograd
    functions) or zero3 (gathers in forward hooks), 2 workers: every graph is compiled by
    the second step and none after (3 graphs for zero3's mlp, 12 for tp's gpt, all in
    the first). Before, dynamo traced the engines' hooks as far as the
    collective and guarded on the Python state they read (the hang detector's count of
    collectives, the ledger's excluded storages), recompiling a frame every step until
    its limit of 8, after which it ran uncompiled (``runtime/untraced``): 8, 11, 13
    graphs after the first three steps of zero3, 11, 15, 19, 23 of tp's first four."""
    args = (kind, "whole", strategy)
    for graphs in paratrain.launch(compiled_workers.graphs_compiled, devices=2, args=args):
        assert graphs[1] > 0 and graphs[-1] == graphs[1], f"graphs after each step: {graphs}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, virtual_stages", [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("1f1b", 2)]
)
def test_a_model_compiled_whole_compiles_its_own_blocks_on_the_pipelines_stages(
    schedule, virtual_stages
):
    """The gpt compiled whole, 10 Adam steps on 2 stages (1F1B, ZB-H1, ZB-H2, interleaved
    over 2 virtual stages): every stage compiles its own blocks' code, every graph by the
    second step and none after, no graph computes on meta tensors, dynamo warns of
    nothing, and the weights equal the uncompiled plain loop's. Before, dynamo traced the
    stage's split-point hooks and shape-only stand-ins (``pipeline/stage_run``): it warned
    that it could not trace ``dict.copy`` (in the hooks' walk of the arguments), compiled
    the stand-ins' meta runs and NaN placeholders into graphs, and recompiled them once
    per module they stood for (7 graphs then 8 on stage 1 here; 13-17 a stage for a
    12-block gpt on 4 stages, past dynamo's limit of 8 recompilations)."""
    args = (schedule, virtual_stages)
    runs = paratrain.launch(compiled_workers.pipeline_compiles, devices=2, args=args)
    plain = plain_loop("gpt", "adam")
    for stage, run in enumerate(runs):
        where = f"stage {stage} of {schedule} x {virtual_stages}"
        assert run["graphs"][1] > 0 and run["graphs"][-1] == run["graphs"][1], (
            f"{where}: graphs after each step {run['graphs']}"
        )
        assert run["meta_values"] == 0, (
            f"{where}: {run['meta_values']} values of the graphs are on meta (stand-ins)"
        )
        assert any(f.endswith("paratrain/models/gpt.py") for f in run["files"]), (
            f"{where}: no graph of the model's own code, only {run['files']}"
        )
        assert not run["warnings"], f"{where}: dynamo warned {run['warnings']}"
    error = relative_error({k: v for run in runs for k, v in run["state"].items()}, plain)
    assert error <= TOLERANCE, f"{schedule} x {virtual_stages}: relative error {error:.2e}"


RESUMES = [
    (("whole", {"strategy": "dp"}), ("not", {"strategy": "zero3"})),
    (("not", {"strategy": "zero2"}), ("whole", {"strategy": "dp"})),
    (("whole", {"strategy": "pipeline", **TWO_STAGES}), ("not", {"strategy": "dp"})),
    (("wrapped", {"strategy": "pipeline", **TWO_STAGES}), ("whole", {"strategy": "zero1"})),
    (("whole", {"strategy": "ps"}), ("not", {"strategy": "ps"})),
]


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", RESUMES)
def test_a_run_resumes_with_compile_turned_on_or_off(tmp_path, saved, resumed):
    """5 Adam steps saved by one engine, 5 more after loading under another, the model
    compiled (whole: names ``_orig_mod.1.weight``; layer by layer: ``1._orig_mod.weight``)
    on one side and not, or otherwise, on the other, against the plain loop's 10: the
    checkpoint is read under the loading model's names, its Adam moments included (a
    resume without them is percent-sized off). Before, every such load was refused as
    "saved from a different model"."""
    path = str(tmp_path / "checkpoint")
    paratrain.launch(compiled_workers.half_run_worker, devices=2, args=(*saved, path, False))
    state = paratrain.launch(
        compiled_workers.half_run_worker, devices=2, args=(*resumed, path, True)
    )[0]
    error = relative_error(state, plain_loop("mlp", "adam"))
    assert error <= TOLERANCE, f"{saved} -> {resumed}: relative error {error:.2e}"


def test_the_ledger_hook_leaves_a_compiled_layer_whole():
    """A forward and backward of the mlp, its Linear modules compiled in place, inside the
    ledger's recording (as every engine meters its passes): no graph break, and the hook
    still counts what autograd saved. Backend "eager": graph breaks are dynamo's, before
    any backend."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = compiled_workers.compiled("mlp", "in place", "eager")
    meter = ActivationMeter()
    for step, (x, y) in enumerate(workers.parity_batches("mlp", steps=3)):
        with meter.record(step):
            loss = loss_for("mlp")(model(x), y)
        loss.backward()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    assert meter.peak > 0


@needs_inductor
def test_a_region_compiled_with_donated_buffers_is_explained(monkeypatch):
    """A region compiled before the pipeline turned donated buffers off (a forward run
    before setup) cannot run B then W: the error says what to change."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):
        pytest.skip("this torch has no donated buffers (added in 2.5)")
    monkeypatch.setattr(functorch_config, "donated_buffer", True)
    torch._dynamo.reset()
    flatten, linear, relu = list(compiled_workers.compiled("mlp", "wrapped", "inductor"))[:3]
    x, _ = workers.parity_batches("mlp", steps=1)[0]
    hidden = linear(flatten(x)).detach().requires_grad_(True)  # a cut layer's input
    out = relu(hidden)  # saves its mask: a buffer inductor's backward reuses
    with pytest.raises(RuntimeError, match="donated_buffer = False before the model's first"):
        with split_backward_limits.explained():
            torch.autograd.grad(out, hidden, torch.ones_like(out), retain_graph=True)
