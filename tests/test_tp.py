"""Tensor parallelism (``strategy="tp"``): parity with one device, the all-reduce count,
canonical checkpoints both ways, and the plan's refusals.

Tolerance: tp computes the same function as one device but sums a rowwise layer's
output over the ranks' partial products (and a colwise layer's input gradient over the
ranks' parts) in another order than one matmul does. Each such sum is off by a few fp32
units in the last place (2^-24 ~ 6e-8 relative) per element; over 10 steps of SGD-momentum
or Adam (whose update divides by sqrt(v), so it can magnify a gradient's relative error
early on, when v is tiny) the weights of dp and pipeline drift by ~1e-7-1e-6 relative on
these models (tests/test_parity_dp.py), and tp's reordering is of the same size: we
hold tp to the same 1e-5 (``TOLERANCE``), about 10x above that drift and far below the
~1e-2 by which one wrong gradient term or a misplaced head changes the weights
(``test_parameters_actually_change`` in test_parity_dp). The losses are compared at the
same 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.checkpoints.format import Checkpoint
from paratrain.parallel import RunSpec, strategy_class
from paratrain.parallel.tensor.plan import resolve_plan
from paratrain.parallel.tensor.shards import ShardSpec
from tests import tp_workers
from tests.readme_examples import run_readme_example
from tests.test_parity_dp import TOLERANCE, relative_error

CASES = [
    ("mlp", "sgd", 1),
    ("mlp", "adam", 2),
    ("gpt", "sgd", 1),
    ("gpt", "adam", 1),
    ("updown", "sgd", 2),
    ("updown", "adam", 1),
    ("updown", "sgd", 1, {"max_grad_norm": 0.1}),
    ("gpt", "adam", 2, {"tp_plan": tp_workers.GPT_VOCAB_PLAN}),
    ("updown_dropout", "sgd", 1),
    ("gpt", "sgd", 2, {"recompute": True}),
]
"""(model, optimizer, accumulation[, engine options]); the clipped case checks that the
norm adds the split slices' squares over the workers and counts the replicated gradients
once; then gpt's token embedding split by rows too (tp only: single has no plan); the
last has dropout on the replicated block outputs and seeds every worker differently
(rank 0 as single): equal only if the tensor group draws one stream, rank 0's; the
recomputed case keeps only each layer's input and runs its forward, all-reduce included,
again in backward."""
PAIRS = {"mlp": 1, "gpt": 4, "updown": 2, "updown_dropout": 2}
"""colwise/rowwise pairs per forward: mlp's hidden pair; gpt's attention and MLP in each
of 2 blocks; the user model's up/down in each of 2 blocks. A vocab embedding adds one
forward all-reduce (its rows summed) and none backward."""


@pytest.fixture(scope="module")
def references():
    return [tp_workers.train_case("single", case)[:2] for case in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [2, 4])
def test_tp_equals_one_device_and_all_reduces_once_per_pair(references, tensor):
    results = paratrain.launch(tp_workers.parity_worker, devices=tensor, args=(CASES,))[0]
    for case, (state, losses, calls), (reference, reference_losses) in zip(
        CASES, results, references, strict=True
    ):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, f"{case} at tensor={tensor}: relative error {error:.2e}"
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
        kind, _, accumulation = case[:3]
        options = (case[3:] or [{}])[0]
        vocab = int("tp_plan" in options and kind == "gpt")
        assert_forward_all_reduces(calls, (PAIRS[kind] + vocab) * accumulation, options, case)
        # mlp's colwise layer takes the input batch, which needs no gradient: no all-reduce
        backward = 0 if kind == "mlp" else PAIRS[kind] * accumulation
        assert calls["backward"] == backward, case


def assert_forward_all_reduces(calls: dict, once: int, options: dict, case) -> None:
    """Exactly one per pair and micro-batch; with ``recompute`` backward replays a
    segment's forward, all-reduces included, up to the last tensor backward needs (torch's
    checkpoint stops there: gpt's mlp all-reduce, read only by the residual add, is not
    replayed), so between one and two per pair."""
    if options.get("recompute"):
        assert once < calls["forward"] <= 2 * once, f"{case}: {calls}"
    else:
        assert calls["forward"] == once, f"{case}: {calls}"


DATA_BY_TENSOR = [
    ("mlp", "sgd", 2, {"tensor": 2}),
    ("gpt", "adam", 1, {"tensor": 2}),
    ("updown", "adam", 2, {"tensor": 2, "max_grad_norm": 0.1}),
]
"""2 replicas x 2 tensor on 4 workers: each replica half the batch, gradients (slices and
whole) averaged over the data groups; the clipped case sums the slices' squares over the
tensor group only (the replicas hold the same gradients by then)."""


@pytest.mark.slow
def test_data_by_tensor_equals_one_device():
    references = [
        tp_workers.train_case("single", (*case[:3], {**case[3], "tensor": None}))[:2]
        for case in DATA_BY_TENSOR
    ]
    results = paratrain.launch(tp_workers.parity_worker, devices=4, args=(DATA_BY_TENSOR,))[0]
    for case, (state, losses, calls), (reference, reference_losses) in zip(
        DATA_BY_TENSOR, results, references, strict=True
    ):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, f"{case}: relative error {error:.2e}"
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
        assert calls["forward"] == PAIRS[case[0]] * case[2], case  # per worker, per micro-batch


def test_parameters_actually_change(references):
    """Guards parity against comparing untouched models."""
    for case, (state, _) in zip(CASES, references, strict=True):
        initial = tp_workers.build(case[0]).state_dict()
        assert relative_error(state, initial) > 1e-3, case


@pytest.mark.slow
def test_checkpoints_load_tp_into_single_and_dp_and_single_into_tp(tmp_path):
    """Adam (moments must travel too): each path resumes 2 steps and equals the others."""
    kind, opt = "gpt", "adam"
    data = tp_workers.batches(kind, 5)
    single = tp_workers.engine("single", kind, opt)
    for x, y in data[:3]:
        single.train_step(x, y)
    single.save_checkpoint(tmp_path / "single")
    for x, y in data[3:]:
        single.train_step(x, y)
    expected = single.state_dict()
    out, ledger = paratrain.launch(
        tp_workers.checkpoint_worker,
        devices=2,
        args=(kind, opt, str(tmp_path / "tp"), str(tmp_path / "single")),
    )[0]
    restored = tp_workers.engine("single", kind, opt)
    restored.load_checkpoint(tmp_path / "tp")
    for x, y in data[3:]:
        restored.train_step(x, y)
    for name, state in {**out, "tp_to_single": restored.state_dict()}.items():
        assert relative_error(state, expected) <= TOLERANCE, name
    # without the optimizer state, Adam's next steps would differ far beyond the tolerance
    fresh = tp_workers.engine("single", kind, opt)
    fresh.load_state_dict(Checkpoint(tmp_path / "tp").model_state())
    for x, y in data[3:]:
        fresh.train_step(x, y)
    assert relative_error(fresh.state_dict(), expected) > 10 * TOLERANCE
    # the ledger books this worker's slices: split layers at 1/2, the rest whole
    plan = resolve_plan(tp_workers.build(kind), 2, None)
    split = (*plan.attention, *plan.splits)
    model = tp_workers.build(kind)
    replicated_bias = {f"{name}.bias" for name, k in plan.splits.items() if k == "rowwise"}
    replicated_bias |= {f"{name}.proj.bias" for name in plan.attention}
    held = sum(
        p.numel() * 4 // (1 if n in replicated_bias or not n.startswith(split) else 2)
        for n, p in model.named_parameters()
    )
    assert ledger["parameters"] == held
    assert ledger["gradients"] == held and ledger["optimizer"] == 2 * held + 4 * len(
        list(model.parameters())
    )


@pytest.mark.slow
def test_readme_example_runs_as_printed(tmp_path):
    completed, printed = run_readme_example("tp_example.py", tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == printed


def test_shard_spec_keeps_whole_heads_of_q_k_and_v():
    full = torch.arange(12.0).reshape(12, 1)  # q rows 0-3, k 4-7, v 8-11
    spec = ShardSpec(dim=0, parts=2, blocks=3)
    assert spec.take(full, 1).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(spec.join([spec.take(full, 0), spec.take(full, 1)]), full)


class Single(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(x)


class NormedBetween(nn.Module):
    """up -> LayerNorm -> down: the norm needs all features, so no split is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def gpt(**overrides):
    from paratrain.models import build_model

    return build_model("gpt", **{**tp_workers.GPT, **overrides})


@pytest.mark.parametrize(
    ("model", "tensor", "plan", "words"),
    [
        (Single, 2, None, "found no layer to split in Single"),
        (NormedBetween, 2, None, "found no layer to split"),
        (tp_workers.UpDownNet, 2, {"*.upp": "colwise"}, "'*.upp' names no module"),
        (tp_workers.UpDownNet, 2, {"blocks.*.up": "colwise"}, "'blocks.0.up' colwise"),
        (tp_workers.UpDownNet, 2, {"*.down": "rowwise"}, "'blocks.0.down' rowwise"),
        (tp_workers.UpDownNet, 2, {"*.norm": "colwise"}, "it is a LayerNorm"),
        (tp_workers.UpDownNet, 3, tp_workers.UPDOWN_PLAN, "32 output features"),
        (gpt, 3, None, "128 output features"),
        (lambda: gpt(n_embd=48, n_head=6), 4, None, "has 6 heads"),
        (lambda: gpt(vocab_size=12, tie_embeddings=True), 2, {"0.token": "vocab"}, "is tied"),
        (NormedBetween, 2, {"up": "colwise", "down": "rowwise"}, "elementwise ops only"),
    ],
)
def test_plan_refusals_name_the_module(model, tensor, plan, words):
    with pytest.raises(ValueError) as error:
        resolve_plan(model(), tensor, plan)
    assert words in str(error.value)


def test_the_plan_is_found_for_the_reference_models_and_kept_by_a_user_plan():
    plan = resolve_plan(tp_workers.build("gpt"), 4, None)
    assert plan.attention == ("1.attn", "2.attn")
    assert plan.splits == {
        f"{b}.mlp.{n}": k for b in (1, 2) for n, k in (("fc", "colwise"), ("proj", "rowwise"))
    }
    assert resolve_plan(tp_workers.build("mlp"), 2, None).splits == {"1": "colwise", "3": "rowwise"}
    user = resolve_plan(tp_workers.UpDownNet(), 2, tp_workers.UPDOWN_PLAN)
    assert sorted(user.splits) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]


def test_check_run_takes_tensor_groups_that_divide_the_workers():
    tp = strategy_class("tp")
    tp.check_run(RunSpec(devices=4, global_batch=8, options={"tensor": 2}))
    assert tp.layout(4, {"tensor": 2}).replicas == 2 and tp.layout(4, {}).replicas == 1
    with pytest.raises(ValueError, match="tensor=3 does not divide 4 workers"):
        tp.check_run(RunSpec(devices=4, global_batch=8, options={"tensor": 3}))
    with pytest.raises(ValueError, match="tensor=1 splits no layer"):
        tp.check_run(RunSpec(devices=4, global_batch=8, options={"tensor": 1}))
    with pytest.raises(ValueError, match="global batch"):
        tp.check_run(RunSpec(devices=4, global_batch=5, options={"tensor": 2}))
