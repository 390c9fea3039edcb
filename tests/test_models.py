"""Tests for paratrain.models: shapes, determinism, registry errors, GPT semantics, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models import (
    MODEL_NAMES,
    build_model,
    count_parameters,
    generate,
    gpt_parameter_count,
    loss_for,
    sequence_cross_entropy,
)
from paratrain.models.gpt import Block, Embedding, gpt
from paratrain.models.lenet import lenet
from paratrain.models.mlp import mlp

TINY_GPT = dict(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _sample_inputs(name: str, batch: int = 3) -> torch.Tensor:
    if name == "gpt":
        return torch.randint(0, 65, (batch, 64))
    return torch.randn(batch, 1, 28, 28)


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 1, 28, 28), (5, 784)])
def test_mlp_accepts_images_and_flat_inputs(shape):
    model = mlp(hidden=32, depth=2, classes=7)
    assert model(torch.randn(*shape)).shape == (5, 7)


def test_mlp_layout_is_flat_linear_relu_pairs():
    model = mlp(hidden=32, depth=3)
    kinds = [type(layer) for layer in model]
    assert kinds == [nn.Flatten] + [nn.Linear, nn.ReLU] * 3 + [nn.Linear]
    assert count_parameters(model) == (784 * 32 + 32) + 2 * (32 * 32 + 32) + (32 * 10 + 10)


def test_mlp_depth_zero_is_logistic_regression():
    model = mlp(depth=0)
    assert [type(layer) for layer in model] == [nn.Flatten, nn.Linear]
    assert model(torch.randn(2, 784)).shape == (2, 10)


def test_lenet_shapes_and_classic_parameter_count():
    model = lenet()
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    # conv1 156 + conv2 2416 + fc 48120 + 10164 + 850: the textbook LeNet-5 count.
    assert count_parameters(model) == 61706
    assert lenet(classes=3, in_channels=3)(torch.randn(2, 3, 28, 28)).shape == (2, 3)


def test_gpt_layout_and_logit_shape():
    model = gpt(**TINY_GPT)
    assert len(model) == TINY_GPT["n_layer"] + 3
    assert isinstance(model[0], Embedding)
    assert all(isinstance(model[i], Block) for i in range(1, TINY_GPT["n_layer"] + 1))
    assert isinstance(model[-2], nn.LayerNorm)
    assert model[-1].bias is None
    tokens = torch.randint(0, 16, (3, 10))
    assert model(tokens).shape == (3, 10, 16)


def test_gpt_rejects_sequences_longer_than_block_size():
    model = gpt(**TINY_GPT)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match="divisible"):
        gpt(n_embd=30, n_head=4)


def test_gpt_init_follows_nanogpt():
    torch.manual_seed(0)
    model = gpt(vocab_size=65, block_size=64, n_layer=8, n_head=4, n_embd=256)
    block = model[1]
    assert block.attn.qkv.bias is None  # see CausalSelfAttention: the key bias is inert
    assert torch.count_nonzero(block.attn.proj.bias) == 0
    # Sample std of n >= 16640 normal draws: relative standard error 1/sqrt(2n) <= 5.5e-3,
    # so rel 0.05 is 9 standard errors or more; torch's default init (std ~ 1/sqrt(3 *
    # fan_in) = 0.036 at width 256) is 80% off.
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)
    assert model[0].token.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model[-1].weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_no_dropout_anywhere():
    for name in MODEL_NAMES:
        model = build_model(name)
        assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


# --- determinism and registry -------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_name_builds_a_sequential_that_runs(name):
    model = build_model(name)
    assert isinstance(model, nn.Sequential)
    out = model(_sample_inputs(name))
    assert out.shape[0] == 3
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_construction_is_deterministic_under_a_seed(name):
    torch.manual_seed(123)
    first = build_model(name).state_dict()
    torch.manual_seed(123)
    second = build_model(name).state_dict()
    torch.manual_seed(124)
    third = build_model(name).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], third[k]) for k in first)


def test_build_model_passes_options():
    model = build_model("mlp", hidden=8, depth=1, classes=4)
    assert model(torch.randn(2, 784)).shape == (2, 4)


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="mlp, lenet, gpt") as info:
        build_model("resnet")
    assert "'resnet'" in str(info.value)
    with pytest.raises(ValueError, match="known models"):
        loss_for("resnet")


def test_unknown_option_is_a_value_error_naming_it_and_the_accepted_ones():
    with pytest.raises(ValueError) as info:
        build_model("mlp", hiddn=64)
    message = str(info.value)
    assert "'hiddn'" in message
    for accepted in ("classes", "depth", "hidden", "in_features"):
        assert accepted in message


def test_bad_option_value_is_a_value_error():
    with pytest.raises(ValueError, match="depth"):
        build_model("mlp", depth=-1)
    with pytest.raises(ValueError, match="n_layer"):
        build_model("gpt", n_layer=0)


def test_loss_for_matches_the_model_outputs():
    assert loss_for("mlp") is F.cross_entropy
    assert loss_for("lenet") is F.cross_entropy
    assert loss_for("gpt") is sequence_cross_entropy


def test_count_parameters_counts_shared_weights_once():
    shared = nn.Linear(4, 4)
    assert count_parameters(nn.Sequential(shared, shared)) == 20


# --- gpt semantics ------------------------------------------------------------------------


def test_sequence_cross_entropy_equals_flattened_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    targets = torch.randint(0, 11, (3, 7))
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    # Exact in principle (the same cross entropy over the same flattened rows): atol 1e-7
    # is under one ulp of a loss near ln 11 = 2.4 (2.4e-7), so this asks for equality.
    assert torch.allclose(sequence_cross_entropy(logits, targets), expected, rtol=0, atol=1e-7)
    # ... and not, say, a sum or a mean of per-sequence sums.
    assert not torch.allclose(sequence_cross_entropy(logits, targets), expected * 7)


def test_sequence_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="trailing vocabulary"):
        sequence_cross_entropy(torch.randn(2, 5, 4), torch.zeros(2, 4, dtype=torch.long))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = gpt(**TINY_GPT).eval()
    tokens = torch.randint(0, 16, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 16
    before, after = model(tokens), model(changed)
    # Exact in principle: a position's logits are computed from the same earlier tokens with
    # the same ops (masked scores are -inf, exp(-inf) = 0 exactly); atol 1e-6 is a few ulps
    # of O(1) logits. A changed token must move later logits by more than 1e-4, a hundred
    # times that.
    assert torch.allclose(before[:, :8], after[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 8:], after[:, 8:], atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        {},
        TINY_GPT,
        dict(vocab_size=100, block_size=7, n_layer=3, n_head=3, n_embd=48),
        dict(vocab_size=1, block_size=1, n_layer=1, n_head=1, n_embd=1),
    ],
)
def test_gpt_parameter_count_matches_the_built_model(config):
    assert gpt_parameter_count(**config) == count_parameters(gpt(**config))


def test_gpt_parameter_count_rejects_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        gpt_parameter_count(n_embd=10, n_head=3)


def test_generate_appends_tokens_reproducibly_and_restores_train_mode():
    torch.manual_seed(0)
    model = gpt(**TINY_GPT)
    model.train()
    prompt = torch.randint(0, 16, (2, 5))
    # 20 new tokens on a block of 16 exercises the context crop.
    first = generate(
        model, prompt, 20, block_size=16, top_k=5, generator=torch.Generator().manual_seed(7)
    )
    assert model.training and all(m.training for m in model.modules())
    assert first.shape == (2, 25)
    assert first.dtype == prompt.dtype
    assert torch.equal(first[:, :5], prompt)
    assert int(first.min()) >= 0 and int(first.max()) < 16

    second = generate(
        model, prompt, 20, block_size=16, top_k=5, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(first, second)
    other = generate(
        model, prompt, 20, block_size=16, top_k=5, generator=torch.Generator().manual_seed(8)
    )
    assert not torch.equal(first, other)

    model.eval()
    generate(model, prompt, 1, block_size=16)
    assert not model.training


def test_generate_top_k_one_is_greedy():
    torch.manual_seed(0)
    model = gpt(**TINY_GPT).eval()
    prompt = torch.randint(0, 16, (1, 4))
    out = generate(model, prompt, 1, block_size=16, top_k=1)
    assert out[0, -1] == model(prompt)[0, -1].argmax()


def test_generate_with_zero_new_tokens_returns_the_prompt():
    model = gpt(**TINY_GPT)
    prompt = torch.randint(0, 16, (1, 3))
    assert torch.equal(generate(model, prompt, 0, block_size=16), prompt)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        (torch.zeros(4, dtype=torch.long), {}, "unsqueeze"),
        (torch.zeros(1, 4), {}, "integer"),
        (torch.zeros(1, 4, dtype=torch.long), {"temperature": 0.0}, "temperature"),
        (torch.zeros(1, 4, dtype=torch.long), {"top_k": 0}, "top_k"),
    ],
)
def test_generate_rejects_bad_arguments(prompt, kwargs, match):
    model = gpt(**TINY_GPT)
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, 2, block_size=16, **kwargs)


# --- gradients flow: overfit one batch ----------------------------------------------------


def _overfit(model: nn.Module, loss_fn, inputs, targets, *, steps: int = 50, lr: float = 1e-2):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_tiny_mlp_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model("mlp", hidden=64, depth=2)
    inputs, targets = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    first, last = _overfit(model, loss_for("mlp"), inputs, targets)
    assert last < first / 100


def test_tiny_gpt_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model("gpt", **TINY_GPT)
    data = torch.randint(0, 16, (4, 17))
    inputs, targets = data[:, :-1], data[:, 1:]
    first, last = _overfit(model, loss_for("gpt"), inputs, targets)
    assert last < first / 50
