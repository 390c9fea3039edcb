"""Pipeline x tensor on models nobody here wrote (issue 25): Hugging Face's Llama and
GPT-2 and the nanoGPT copy cut at named split points (each stage splits the attention
heads and MLP pairs of the blocks it holds over its tensor group), and nanoGPT's blocks as
a layer list; padded dict batches with attention masks; the plan found, Llama's config
plan (``tp_plan="auto"``) and an explicit one; the model's own loss with
``num_items_in_batch``.

Reference: one process over the same 2 parts (``gradient_accumulation=2``, the pipeline's
2 micro-batches), so that both add the same partial sums. Tolerance: the suite's
``TOLERANCE`` (1e-5 relative per tensor, on parameters and losses), as in
tests/test_tp_models.py and tests/test_hf_models.py: the split adds a rowwise layer's
products as 2 partial sums and GPT-2's and nanoGPT's tied head and embedding on two
stages, each moving a gradient by a few units of 2^-24 per step; SGD-momentum carries
that linearly over these 4 steps. AdamW likewise, except the key third of a packed
attention bias (GPT-2's and nanoGPT's ``c_attn.bias``), whose gradient is zero
analytically and whose rounding noise Adam scales up to lr per step (see
tests/test_tp_models.py); SGD compares it at the full bar. A wrong split (a slice taken
as whole across a split point, a head reading another's keys) is off by ~1e-1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.options import RunSpec
from paratrain.parallel.pipeline.partition import PartitionError
from paratrain.parallel.registry import strategy_class
from tests import hf_workers, pp_tp_workers, tp_model_workers
from tests.test_parity_dp import TOLERANCE, relative_error
from tests.test_tp_vocab import VOCAB_TOLERANCE

pytest.importorskip("transformers", reason="the dev extra installs transformers")

RUNS = [
    ("llama", "sgd", {}),
    ("llama", "adam", {"tp_plan": "auto", "schedule": "gpipe"}),
    ("llama", "sgd", {"tp_plan": tp_model_workers.LLAMA_PLAN}),
    ("gpt2", "sgd", {}),
    ("gpt2", "adam", {}),
    ("nanogpt", "sgd", {}),
    ("nanogpt", "adam", {}),
    ("nanogpt_list", "sgd", {}),
    ("nanogpt_list", "adam", {}),
]
"""(model, optimizer, options) at 2 stages x tensor 2, 2 micro-batches (1F1B but where
named)."""
OWN_LOSS = [
    ("llama", {}),
    (
        "gpt2",
        {
            "tp_plan": {
                "transformer.h.*.mlp.c_fc": "colwise",
                "transformer.h.*.mlp.c_proj": "rowwise",
            }
        },
    ),
]
"""(model, options) with the labels in the batch and ``outputs.loss``."""


def reference(kind: str, opt: str) -> tuple[dict, list[float]]:
    return pp_tp_workers.train("single", kind, opt, gradient_accumulation=2)


@pytest.mark.slow
def test_stages_by_tensor_train_hugging_face_and_nanogpt_as_one_process(tmp_path):
    """4 workers: 2 stages x tensor 2, 4 steps each. Each checkpoint holds the whole
    tensors under the model's own names (loaded strictly into a fresh model, equal to
    ``state_dict()`` to the bit); Llama's resumes under the same layout as under one
    process."""
    results, resumed, owned = paratrain.launch(
        pp_tp_workers.parity_worker, devices=4, args=(RUNS, OWN_LOSS, str(tmp_path))
    )[0]
    for index, (run, (state, losses)) in enumerate(zip(RUNS, results, strict=True)):
        fresh = pp_tp_workers.build(run[0])
        fresh.load_state_dict(paratrain.load_model_state(str(tmp_path / str(index))), strict=True)
        assert relative_error(dict(fresh.state_dict()), state) == 0.0, run
        expected, expected_losses = reference(run[0], run[1])
        assert relative_error(expected, pp_tp_workers.build(run[0]).state_dict()) > 1e-3
        if run[1] == "adam":
            state = tp_model_workers.without_key_bias(state)
            expected = tp_model_workers.without_key_bias(expected)
        # "auto" splits Llama's lm head by vocabulary too: tests/test_tp_vocab.py's bound
        bound = VOCAB_TOLERANCE if run[2].get("tp_plan") == "auto" else TOLERANCE
        error = relative_error(state, expected)
        assert error <= bound, (run, error)
        assert losses == pytest.approx(expected_losses, rel=bound), run
    single_state, single_loss = hf_workers.resume("single", "llama", str(tmp_path / "1"))
    assert resumed[1] == pytest.approx(single_loss, rel=VOCAB_TOLERANCE)  # run 1: "auto"
    assert relative_error(resumed[0], single_state) <= VOCAB_TOLERANCE
    for (kind, _), (state, losses) in zip(OWN_LOSS, owned, strict=True):
        [(expected, expected_losses)] = hf_workers.train_own_loss(
            [("single", kind, {"gradient_accumulation": 2})]
        )
        assert relative_error(state, expected) <= TOLERANCE, kind
        assert losses == pytest.approx(expected_losses, rel=TOLERANCE), kind


@pytest.mark.slow
def test_replicas_by_stages_by_tensor_train_as_one_process():
    """8 workers: 2 replicas x 2 stages x tensor 2, Llama with SGD-momentum and GPT-2 (its
    head tied across the stages) with AdamW; one process accumulating the same 4 parts
    (2 replicas x 2 micro-batches of 2 samples)."""
    runs = [("llama", "sgd"), ("gpt2", "adam")]
    results = paratrain.launch(pp_tp_workers.replicas_worker, devices=8, args=(runs,))[0]
    for (kind, opt), (state, losses) in zip(runs, results, strict=True):
        expected, expected_losses = pp_tp_workers.train(
            "single", kind, opt, gradient_accumulation=4
        )
        if opt == "adam":
            state = tp_model_workers.without_key_bias(state)
            expected = tp_model_workers.without_key_bias(expected)
        assert relative_error(state, expected) <= TOLERANCE, kind
        assert losses == pytest.approx(expected_losses, rel=TOLERANCE), kind


class Straddling(nn.Module):
    """An MLP whose blocks are its own layers, so that a split point falls inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def check(build, **options) -> None:
    run = RunSpec(devices=4, global_batch=8, options={"stages": 2, **options}, build_model=build)
    strategy_class("pipeline").check_run(run)


def test_named_split_points_take_tensor_and_refuse_a_pair_they_cut_apart():
    """Checked before launch on the meta model: the named cut now takes a tensor degree
    (the heads checked per model), and a colwise layer whose rowwise partner starts the
    next stage is refused (its slice would cross the split point as if whole)."""
    llama = lambda: tp_model_workers.build("llama").to("meta")  # noqa: E731
    check(llama, tensor=2, split_points=["model.layers.1"], tp_plan="auto")
    heads = "attention .transformer.h.0.attn. has 2 heads, which tensor=4"
    with pytest.raises(ValueError, match=heads):
        run = RunSpec(
            devices=8,
            global_batch=8,
            options={"stages": 2, "tensor": 4, "split_points": ["transformer.h.1"]},
            build_model=lambda: tp_model_workers.build("gpt2").to("meta"),
        )
        strategy_class("pipeline").check_run(run)
    with pytest.raises(PartitionError) as refused:
        check(Straddling, tensor=2, split_points=["body.2"])
    assert str(refused.value) == (
        "the tensor plan splits 'body.0' (colwise), but 'body' holds state on more than one "
        "stage, so its slices would cross split point(s) ['body.2']; choose split points "
        "between the blocks that hold the split layers, or replicate it in tp_plan."
    )
