"""Synthetic datasets: deterministic, correctly shaped, and actually learnable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.data import synthetic_classification, synthetic_images, synthetic_tokens


def test_classification_shapes_and_determinism() -> None:
    a = synthetic_classification(64, in_features=20, classes=5, seed=3)
    b = synthetic_classification(64, in_features=20, classes=5, seed=3)
    c = synthetic_classification(64, in_features=20, classes=5, seed=4)
    x, y = a.tensors
    assert x.shape == (64, 20) and x.dtype == torch.float32
    assert y.shape == (64,) and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < 5
    assert torch.equal(x, b.tensors[0]) and torch.equal(y, b.tensors[1])
    assert not torch.equal(x, c.tensors[0])


def test_classification_features_have_unit_scale_and_all_classes() -> None:
    x, y = synthetic_classification(2048).tensors
    assert x.shape == (2048, 784)
    assert abs(x.mean().item()) < 0.05
    assert 0.9 < x.std().item() < 1.1
    assert torch.bincount(y, minlength=10).min() > 50  # no class missing or starved


def _fit_linear(train, val, steps: int = 150) -> tuple[float, float]:
    x, y = train.tensors
    xv, yv = val.tensors
    model = torch.nn.Linear(x[0].numel(), 10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x.flatten(1)), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(xv.flatten(1)).argmax(1) == yv).float().mean().item()
    return loss.item(), accuracy


def test_classification_is_learnable_and_seeds_share_the_teacher() -> None:
    torch.manual_seed(0)
    loss, accuracy = _fit_linear(
        synthetic_classification(2048), synthetic_classification(512, seed=1)
    )
    assert loss < 0.3
    assert accuracy > 0.8  # the validation set (other seed) is the same task


def test_images_are_learnable_and_shaped() -> None:
    torch.manual_seed(0)
    train, val = synthetic_images(2048), synthetic_images(512, seed=1)
    images, labels = train.tensors
    assert images.shape == (2048, 1, 28, 28) and labels.dtype == torch.int64
    assert 0.9 < images.std().item() < 1.1
    loss, accuracy = _fit_linear(train, val)
    assert loss < 0.3 and accuracy > 0.75


def test_images_other_shapes() -> None:
    images, labels = synthetic_images(10, channels=3, size=16, classes=4, seed=2).tensors
    assert images.shape == (10, 3, 16, 16)
    assert labels.max() < 4


def test_tokens_follow_a_fixed_successor_table() -> None:
    inputs, targets = synthetic_tokens(200, block_size=16, vocab_size=11).tensors
    assert inputs.shape == targets.shape == (200, 16)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
    assert 0 <= inputs.min() and targets.max() < 11
    successor = {}
    for a, b in zip(inputs.reshape(-1).tolist(), targets.reshape(-1).tolist(), strict=True):
        assert successor.setdefault(a, b) == b  # a token always has the same successor
    other_inputs, other_targets = synthetic_tokens(50, block_size=16, vocab_size=11, seed=9).tensors
    for a, b in zip(
        other_inputs.reshape(-1).tolist(), other_targets.reshape(-1).tolist(), strict=True
    ):
        assert successor.get(a, b) == b  # and the table does not depend on the seed
    assert torch.unique(inputs[:, 0]).numel() > 5  # starts vary


def test_generators_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    synthetic_classification(8)
    synthetic_images(8)
    synthetic_tokens(8)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "call",
    [
        lambda: synthetic_classification(0),
        lambda: synthetic_classification(4, classes=1),
        lambda: synthetic_images(4, size=0),
        lambda: synthetic_tokens(4, vocab_size=-1),
    ],
)
def test_bad_sizes_are_refused(call) -> None:
    with pytest.raises(ValueError, match="must be"):
        call()
