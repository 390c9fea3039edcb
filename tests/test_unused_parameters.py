"""Parameters that a step does not use train as in the plain loop: dp and ZeRO equal it.

The model (``workers.Branchy``) has a branch that only some samples take, so that at a
given step it is unused on every replica, or used on some replicas and not on others; a
layer that only some steps run; and a parameter never used. The plain loop leaves such a
parameter's ``.grad`` None and the optimizer skips it (no momentum decay, no Adam step,
no weight decay); handing it a zero gradient instead was 3-13% off after 10 steps.

Tolerances are the parity suite's (``TOLERANCE``, 1e-5 relative on every parameter,
``relative_error``; 1e-5 on each step's loss): the engines compute the same updates as
one device, and what separates them is the order of fp32 sums (an all-reduce or
reduce-scatter against one backward over the whole batch), about 1e-7 relative per step.
A defect here (a skipped parameter stepped, a used one skipped, a share lost) is
percent-sized, as the figures above show.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import paratrain
from paratrain.checkpoints.format import Checkpoint
from paratrain.models import loss_for
from tests import workers, zero_workers
from tests.schedule_memory_workers import SCHEDULES
from tests.test_parity_dp import TOLERANCE, relative_error

OPTIMIZERS = ("sgd", "adam", "adamw", "sgd_damped")
CASES = [("branchy", name, k) for name, k in itertools.product(OPTIMIZERS, (1, 2))]


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: workers.train_with("single", *case) for case in CASES}


def plain_loop(optimizer: str, kind: str = "branchy") -> tuple[dict, list[list[str]]]:
    """The plain PyTorch loop; also which parameters had no gradient at each step."""
    model = workers.parity_model(kind)
    opt = workers.parity_optimizer(optimizer)(model.parameters())
    loss_fn = loss_for("mlp")
    without_grad = []
    for x, y in workers.parity_batches(kind):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        without_grad.append([n for n, p in model.named_parameters() if p.grad is None])
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, without_grad


def test_the_model_leaves_parameters_unused_as_intended():
    """Guards the tests below: the schedule has steps where the branch is unused everywhere,
    where only some replicas' shares take it, and the rare layer runs at some steps."""
    _, without_grad = plain_loop("sgd")
    branch = {"body.branch.weight", "body.branch.bias"}
    rare = {"rare.weight", "rare.bias"}
    for step, missing in enumerate(without_grad):
        assert "never" in missing and "body.main.weight" not in missing
        assert (branch <= set(missing)) == (not workers.BRANCH_SAMPLES[step])
        assert (rare <= set(missing)) == (step not in workers.RARE_STEPS)
    # steps 1 and 4: one replica's share at 2 and 4 workers; step 6: two of four shares
    assert workers.BRANCH_SAMPLES[1] == (0, 1, 2, 3) and workers.BRANCH_SAMPLES[6] == (5, 9)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_single_engine_equals_the_plain_loop(optimizer, references):
    state, _ = references[("branchy", optimizer, 1)]
    plain, _ = plain_loop(optimizer)
    assert relative_error(state, plain) <= TOLERANCE
    assert torch.equal(state["never"], torch.ones(3))  # AdamW's decay never touched it


def check(runs: list[tuple[dict, list[float]]], cases, references, label: str) -> None:
    for case, (state, losses) in zip(cases, runs, strict=True):
        ref_state, ref_losses = references[case]
        error = relative_error(state, ref_state)
        assert error <= TOLERANCE, f"{label} {case}: relative error {error:.2e}"
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE), (label, case)
        assert torch.equal(state["never"], torch.ones(3)), (label, case)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_dp_equals_the_plain_loop(devices, references):
    """dp builds torch's fused SGD/Adam here (``fused_optim``), so this also runs the
    fused kernel's fallback for SGD's late first gradients."""
    results = paratrain.launch(workers.dp_parity_worker, devices=devices, args=(CASES, {}))
    for rank, runs in enumerate(results):
        check(runs, CASES, references, f"dp rank {rank} of {devices}")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_zero_stages_equal_the_plain_loop(devices, references):
    """Default buckets put every parameter in one zero1/2 unit (used and unused mixed);
    zero3's units are ``body`` (mixed), ``head``, ``rare`` and the root (``bias`` beside
    ``never``)."""
    results = paratrain.launch(
        zero_workers.zero_parity_worker,
        devices=devices,
        args=(list(zero_workers.STAGES), CASES, {}),
    )
    for rank, by_stage in enumerate(results):
        for stage, runs in by_stage.items():
            check(runs, CASES, references, f"{stage} rank {rank} of {devices}")


@pytest.mark.slow
def test_zero_one_unit_per_parameter(references):
    """Tiny buckets: a unit per parameter, so whole units go unused."""
    cases = [("branchy", "sgd", 1), ("branchy", "adam", 2)]
    results = paratrain.launch(
        zero_workers.zero_parity_worker,
        devices=2,
        args=(["zero1", "zero2"], cases, {"bucket_mb": 0.0001}),
    )
    for stage, runs in results[0].items():
        check(runs, cases, references, stage)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd_damped"])
def test_checkpoints_keep_each_parameters_own_history(tmp_path, optimizer, references):
    """After unused steps the parameters' optimizer bookkeeping differs (Adam's step count,
    SGD's buffer missing until the first gradient); it survives zero2 -> dp -> zero3 ->
    single at other device counts, as an uninterrupted run."""
    reference, reference_losses = references[("branchy", optimizer, 1)]
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    phases = [("zero2", 2, (0, 3), None, a), ("dp", 4, (3, 5), a, b), ("zero3", 4, (5, 8), b, c)]
    losses = []
    for strategy, devices, steps, load_from, save_to in phases:
        losses += paratrain.launch(
            workers.checkpoint_phase,
            devices=devices,
            args=(strategy, {}, "branchy", optimizer, steps, load_from, save_to),
        )[0][1]
    state, last = workers.checkpoint_phase("single", {}, "branchy", optimizer, (8, 10), c, None)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses + last == pytest.approx(reference_losses, rel=TOLERANCE)
    saved = Checkpoint(c)
    assert not [n for n in saved.names("optim") if n.startswith("never/")]  # as torch: none
    if optimizer == "adam":  # the branch sat out steps 0, 2, 5, 7 of the first 8
        assert float(saved.tensor("optim", "body.branch.weight/step")) == 4.0
        assert float(saved.tensor("optim", "body.main.weight/step")) == 8.0


# ---- the pipeline: every schedule on the same gate as a layer list -----------------------

LAYER_OPTIMIZERS = ("sgd", "adam", "adamw")


def test_the_layer_list_leaves_parameters_unused_as_intended():
    """Guards the pipeline test below: ``branchy_layers`` (PositiveScale, GatedBlock,
    WithNever, Linear) has steps where the gated branch is unused by the whole batch, steps
    where some micro-batches take it and others do not, and a parameter never used; the
    test's balances put both behind the first stage, fed data (whose W is one backward)."""
    _, without_grad = plain_loop("sgd", "branchy_layers")
    branch = {"1.branch.weight", "1.branch.bias"}
    for step, missing in enumerate(without_grad):
        assert "2.never" in missing and "1.main.weight" not in missing
        assert (branch <= set(missing)) == (not workers.BRANCH_SAMPLES[step])


def _two_stages(options: dict) -> dict:
    """A schedule's options at 2 stages of 4 micro-batches, the gate and the unused
    parameter behind the first stage: ``[1, 3]``, or a layer a piece for interleaved."""
    balance = [1, 1, 1, 1] if "virtual_stages" in options else [1, 3]
    return {"stages": 2, "micro_batches": 4, "balance": balance, **options}


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_every_pipeline_schedule_equals_the_plain_loop(devices):
    """Each schedule at 2 stages (at 4 workers, 2 replicas of them, and ZB-H2 at 4 stages),
    4 micro-batches, the gate and the unused parameter on stages fed by another, against
    the plain loop. A micro-batch that does not take the branch leaves its module uncalled
    (under the zero-bubble schedules, a unit with no call); a step none of whose
    micro-batches (nor, with replicas, any replica's) take it must leave the branch's
    ``.grad`` None, as the plain loop does, so that the optimizer skips it: a zero gradient
    moves the parameter under momentum, Adam and AdamW (a W that filled the unreached
    parameters' gradients with zeros ended 2% off after the 10 steps). Tolerance: the
    suite's, as above (the micro-batches' sums in the pipeline's order against one
    backward over the batch)."""
    runs = [
        (name, optimizer, _two_stages(options))
        for name, options in SCHEDULES.items()
        for optimizer in LAYER_OPTIMIZERS
    ]
    if devices == 4:
        four = {"stages": 4, "micro_batches": 4, "schedule": "zb-h2", "balance": [1, 1, 1, 1]}
        runs += [("zb-h2, 4 stages", optimizer, four) for optimizer in LAYER_OPTIMIZERS]
    cases = [("branchy_layers", optimizer, 1) for _, optimizer, _ in runs]
    results = paratrain.launch(
        workers.pipeline_parity_worker, devices=devices, args=(cases, [o for *_, o in runs])
    )
    plain = {name: plain_loop(name, "branchy_layers")[0] for name in LAYER_OPTIMIZERS}
    single = {
        name: workers.train_with("single", "branchy_layers", name, 1)[1]
        for name in LAYER_OPTIMIZERS
    }
    for (name, optimizer, _), (state, losses) in zip(runs, results[0], strict=True):
        label = f"{name} {optimizer} at {devices} workers"
        error = relative_error(state, plain[optimizer])
        assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"
        assert losses == pytest.approx(single[optimizer], rel=TOLERANCE), label
        assert torch.equal(state["2.never"], torch.ones(3)), label
