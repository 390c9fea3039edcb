"""A vocabulary-split embedding and lm head (issue 25, "Embedding and head"): our gpt
(tied and untied), Hugging Face's GPT-2 (tied) and Llama (untied), at tensor 2 and 4 and
dp 2 x tensor 2, trained as one process; the cross-entropy on split logits; checkpoints
whole; refusals.

Tolerance ``VOCAB_TOLERANCE`` (relative, per parameters and losses): the split runs the
single process's fp32 operations except for the order of three sums. The softmax's sum
of ``exp`` over the ``V`` logits is taken as ``t`` partial sums added by an all-reduce; a
reordered sum of ``V`` same-signed terms moves by at most ``V u`` relative (u = 2^-24),
and the two orders differ by at most ``2 V u``; the softmax (so each logit's gradient)
inherits it. The head's input gradient sums ``V`` products over ``t`` ranks: another
``V u``. The blocks' split layers and the replicas' all-reduce add what
tests/test_parity_dp.py bounds (``TOLERANCE``). An update at most the parameters' size
carries each step's relative change into them: ``STEPS (3 V u) + TOLERANCE`` = 5.6e-5
for V = 64, 4 steps. Measured: 4.7e-7 and below (SGD), up to 7.6e-6 (Adam, on a
LayerNorm bias: Adam's update does not shrink with a small gradient's rounding). GPT-2's
packed key bias is left out under Adam, as in tests/test_tp_models.py (its gradient is
zero analytically, noise that Adam moves by lr). A wrong loss is far off: without the
all-reduce of the ``exp`` sums and target logits (each rank's softmax over its own range
alone), gpt ends 2.4 and Llama 0.098 off; every state is also checked to be ~1e-3 or more
from the untrained model, so a run that trained nothing cannot pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoints.model_state import load_model_state
from paratrain.parallel.tensor import vocab_loss
from paratrain.parallel.tensor.layers import VocabHead
from paratrain.parallel.tensor.mappings import LOCAL
from paratrain.parallel.tensor.plan import resolve_plan
from tests import vocab_workers
from tests.test_parity_dp import TOLERANCE, relative_error
from tests.tp_model_workers import without_key_bias

pytest.importorskip("transformers", reason="the dev extra installs transformers")

UNIT = 2.0**-24
VOCAB_TOLERANCE = vocab_workers.STEPS * 3 * vocab_workers.VOCAB * UNIT + TOLERANCE

TENSOR_2 = [
    ("gpt", "sgd", "summed", {}),
    ("gpt", "adam", "summed", {}),
    ("gpt_tied", "sgd", "summed", {}),
    ("gpt_tied", "adam", "mean", {}),
    ("gpt2", "sgd", "summed", {}),
    ("gpt2", "adam", "summed", {}),
    ("llama", "sgd", "summed", {}),
    ("llama", "adam", "summed", {}),
    ("gpt2", "sgd", "model", {}),
]
"""(model, optimizer, loss form, options) on 2 workers: every loss form kept split, and
Hugging Face's ``outputs.loss`` (the head gathers)."""
FOUR_WORKERS = [
    ("gpt", "adam", "summed", {"tensor": 4}),
    ("gpt_tied", "sgd", "summed", {"tensor": 4}),
    ("gpt2", "adam", "summed", {"tensor": 4}),
    ("llama", "sgd", "summed", {"tensor": 4}),
    ("gpt_tied", "adam", "summed", {"tensor": 2}),
    ("gpt2", "sgd", "summed", {"tensor": 2}),
    ("llama", "adam", "summed", {"tensor": 2}),
]
"""On 4 workers: tensor 4, and dp 2 x tensor 2 (replicas with uneven token counts)."""


def assert_trains_as_one_process(run: tuple, state: dict, losses: list[float]) -> None:
    """``run``'s final state and losses against one process training the same batches
    (which itself must have moved from the untrained model), within ``VOCAB_TOLERANCE``;
    Adam on GPT-2 without its packed key bias (see ``without_key_bias``)."""
    kind, opt = run[0], run[1]
    reference, reference_losses, _ = vocab_workers.train(run, split=False)
    assert relative_error(reference, vocab_workers.build(kind).state_dict()) > 1e-3
    if opt == "adam" and kind == "gpt2":
        state, reference = without_key_bias(state), without_key_bias(reference)
    error = relative_error(state, reference)
    assert error <= VOCAB_TOLERANCE, (run, error)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True))
    assert loss_error <= VOCAB_TOLERANCE, (run, loss_error)


def _check(runs: list[tuple], results: list, devices: int) -> None:
    for run, (state, losses, head) in zip(runs, results, strict=True):
        kind, _, form, options = run
        tensor = options.get("tensor", devices)
        assert head["rows"] == head["embedding_rows"] == vocab_workers.VOCAB // tensor, run
        assert head["tied"] == (kind in ("gpt_tied", "gpt2")), run
        assert head["gather"] == (form == "model"), run
        assert_trains_as_one_process(run, state, losses)


@pytest.mark.slow
def test_vocab_split_trains_as_one_process_at_tensor_2():
    results = paratrain.launch(vocab_workers.parity_worker, devices=2, args=(TENSOR_2,))[0]
    _check(TENSOR_2, results, 2)


@pytest.mark.slow
def test_vocab_split_trains_as_one_process_at_tensor_4_and_dp_x_tensor():
    results = paratrain.launch(vocab_workers.parity_worker, devices=4, args=(FOUR_WORKERS,))[0]
    _check(FOUR_WORKERS, results, 4)


@pytest.mark.slow
def test_vocab_split_checkpoint_loads_into_one_process_strict(tmp_path):
    """Saved under tensor 2 (tied GPT-2, untied Llama, tied gpt), the checkpoint holds the
    whole tensors: a single-process model loads it strict and equals the engine's state."""
    runs = [
        ("gpt2", "adam", "summed", {}),
        ("llama", "sgd", "summed", {}),
        ("gpt_tied", "sgd", "summed", {}),
    ]
    states = paratrain.launch(
        vocab_workers.checkpoint_worker, devices=2, args=(runs, str(tmp_path))
    )[0]
    for index, (run, state) in enumerate(zip(runs, states, strict=True)):
        model = vocab_workers.build(run[0])
        model.load_state_dict(load_model_state(tmp_path / str(index), model=model), strict=True)
        assert relative_error(model.state_dict(), state) == 0.0, run


def _head(vocab: int, width: int) -> VocabHead:
    torch.manual_seed(3)
    return VocabHead(nn.Linear(width, vocab), rank=0, tensor=1, group=LOCAL)


def test_vocab_cross_entropy_on_one_shard_equals_torch_forward_and_backward():
    """On one member (tensor 1, nothing sent) the sharded cross-entropy is
    ``F.cross_entropy``'s, -100 ignored, and so is its gradient: fp32, a few units of
    2^-24 apart (the same sums, another kernel's order)."""
    head = _head(11, 5)
    logits = torch.randn(7, 11, requires_grad=True)
    targets = torch.tensor([3, -100, 0, 10, 5, -100, 7])
    ours = vocab_loss.vocab_parallel_cross_entropy(logits, targets, head, ignore_index=-100)
    (ours * torch.arange(1.0, 8.0)).sum().backward()
    grad, logits.grad = logits.grad, None
    theirs = F.cross_entropy(logits, targets, reduction="none")
    (theirs * torch.arange(1.0, 8.0)).sum().backward()
    assert torch.allclose(ours, theirs, rtol=0, atol=64 * UNIT * float(theirs.detach().abs().max()))
    assert torch.allclose(grad, logits.grad, rtol=0, atol=64 * UNIT)
    assert float(ours[1].detach()) == 0.0 and float(grad[1].abs().sum()) == 0.0


def test_a_target_outside_the_vocabulary_is_refused():
    head = _head(11, 5)
    with pytest.raises(ValueError, match=r"target 11 lies outside the vocabulary \[0, 11\)"):
        vocab_loss.vocab_parallel_cross_entropy(
            torch.randn(2, 11), torch.tensor([1, 11]), head, ignore_index=-100
        )


def test_only_paratrains_token_losses_keep_the_logits_split(capsys):
    """A lambda (or Hugging Face's ``outputs.loss``) reads logits we cannot see: gathered,
    said in one line; a tally's wrapper is not taken for the loss it wraps."""
    from paratrain.losses import causal_lm_cross_entropy
    from paratrain.models.gpt import sequence_cross_entropy
    from paratrain.parallel.metric_tally import ObservedLoss

    model = nn.Sequential(nn.Linear(4, 4), _head(8, 4))
    assert type(vocab_loss.sharded_loss(causal_lm_cross_entropy, model)).__name__ == (
        "SummedVocabLoss"
    )
    assert model[1].gather is False
    assert type(vocab_loss.sharded_loss(sequence_cross_entropy, model)).__name__ == (
        "MeanVocabLoss"
    )
    sharded = vocab_loss.sharded_loss(sequence_cross_entropy, model)
    assert vocab_loss.gathered(sharded) is sequence_cross_entropy  # a tally opened
    assert model[1].gather is True
    assert vocab_loss.sharded_loss(ObservedLoss(sequence_cross_entropy), model) is None
    assert vocab_loss.sharded_loss(lambda out, y: out.sum(), model) is None
    assert model[1].gather is True
    assert "so its logits are gathered on every rank" in capsys.readouterr().out


def test_an_undivided_vocabulary_is_refused_naming_the_sizes_that_divide():
    model = nn.Sequential(nn.Embedding(50257, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    plan = {"0": "vocab", "1": "colwise", "3": "rowwise"}
    with pytest.raises(ValueError, match=r"50257 token ids, which tensor=2 does not divide"):
        resolve_plan(model, 2, plan)
    model = nn.Sequential(nn.Embedding(50304, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"divides 50304 \(2, 3, 4, 6, 8, 12, 16, 24\)"):
        resolve_plan(model, 5, plan)


def test_a_tie_split_on_one_side_only_is_refused():
    """gpt tied: the embedding split by vocabulary and the head replicated would make one
    tensor two different ones."""
    model = vocab_workers.build("gpt_tied")
    plan = {k: v for k, v in vocab_workers.GPT_PLAN.items() if k != "4"}
    with pytest.raises(ValueError, match="make every module holding it 'vocab'"):
        resolve_plan(model, 2, plan)
    resolve_plan(model, 2, vocab_workers.GPT_PLAN)  # both sides: accepted
