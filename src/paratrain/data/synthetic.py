"""Synthetic datasets that need no download and that a model can actually learn.

They exist for tests, benchmarks and first runs: deterministic from ``seed``, any size,
and shaped like the real datasets (784 features or 1x28x28 images with 10 classes, and
character-like token windows). Each one is labelled by a fixed "teacher" that depends
only on the shapes, never on ``seed``: ``seed`` picks the samples, so two calls with
different seeds give a training set and a validation set of the *same* task.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

__all__ = ["synthetic_classification", "synthetic_images", "synthetic_tokens"]

# Seeds of the fixed teachers; distinct so the three tasks are unrelated.
_CLASSIFICATION_TEACHER_SEED = 1_234_567
_IMAGE_TEACHER_SEED = 2_345_678
_TOKEN_TEACHER_SEED = 3_456_789
_LATENT_DIM = 32
_NOISE = 0.1


def synthetic_classification(
    n: int, *, in_features: int = 784, classes: int = 10, seed: int = 0
) -> TensorDataset:
    """``n`` Gaussian vectors (unit variance per feature) labelled by a fixed linear teacher.

    The vectors lie near a 32-dimensional subspace (a fixed random mixing of 32 latent
    Gaussians, plus a little isotropic noise) and the label is the argmax of a fixed
    linear map of the latents. Without that structure a linear teacher in 784
    dimensions needs far more than a few thousand samples to generalize; with it an MLP
    reaches high validation accuracy, so a falling validation loss means something.
    """
    _check_positive(n=n, in_features=in_features, classes=classes)
    latent = min(_LATENT_DIM, in_features)
    teacher = _generator(_CLASSIFICATION_TEACHER_SEED)
    mixing = torch.randn(latent, in_features, generator=teacher)
    mixing = mixing / mixing.norm(dim=0, keepdim=True)  # each feature gets unit variance
    weights = torch.randn(latent, classes, generator=teacher)
    samples = _generator(seed)
    z = torch.randn(n, latent, generator=samples)
    noise = torch.randn(n, in_features, generator=samples)
    inputs = (z @ mixing + _NOISE * noise) / math.sqrt(1.0 + _NOISE**2)
    return TensorDataset(inputs, (z @ weights).argmax(dim=1))


def synthetic_images(
    n: int, *, channels: int = 1, size: int = 28, classes: int = 10, seed: int = 0
) -> TensorDataset:
    """``n`` smooth images ``(channels, size, size)`` labelled by fixed class templates.

    Each image is coarse Gaussian noise (a ``size // 4`` grid) upsampled bilinearly,
    scaled to unit variance per pixel, plus a little pixel noise; the label is the argmax
    of a fixed linear map of the coarse grid. The signal is spatially smooth, the kind of
    structure convolutions and pooling (LeNet) pick up, and generalizes from a few
    thousand samples.
    """
    _check_positive(n=n, channels=channels, size=size, classes=classes)
    coarse = max(size // 4, 1)
    latent = channels * coarse * coarse
    weights = torch.randn(latent, classes, generator=_generator(_IMAGE_TEACHER_SEED))
    samples = _generator(seed)
    z = torch.randn(n, channels, coarse, coarse, generator=samples)
    noise = torch.randn(n, channels, size, size, generator=samples)
    smooth = _upsample(z, size) / _upsample_std(coarse, size)
    images = (smooth + _NOISE * noise) / math.sqrt(1.0 + _NOISE**2)
    return TensorDataset(images, (z.reshape(n, latent) @ weights).argmax(dim=1))


def synthetic_tokens(
    n: int, *, block_size: int = 64, vocab_size: int = 65, seed: int = 0
) -> TensorDataset:
    """``n`` token windows ``(inputs, targets)`` where ``targets`` is ``inputs`` shifted by one.

    Each sequence starts at a random token and then follows a fixed random successor
    table (token ``t`` is always followed by ``successor[t]``), so everything after the
    first token is predictable and a small GPT's loss falls quickly towards zero.
    """
    _check_positive(n=n, block_size=block_size, vocab_size=vocab_size)
    successor = torch.randperm(vocab_size, generator=_generator(_TOKEN_TEACHER_SEED))
    sequences = torch.empty(n, block_size + 1, dtype=torch.long)
    sequences[:, 0] = torch.randint(vocab_size, (n,), generator=_generator(seed))
    for t in range(block_size):
        sequences[:, t + 1] = successor[sequences[:, t]]
    return TensorDataset(sequences[:, :-1].clone(), sequences[:, 1:].clone())


def _upsample(grid: torch.Tensor, size: int) -> torch.Tensor:
    return F.interpolate(grid, size=(size, size), mode="bilinear", align_corners=False)


def _upsample_std(coarse: int, size: int) -> torch.Tensor:
    """Per-pixel standard deviation of upsampled unit Gaussian noise (exact, not sampled),
    so images have unit variance whatever ``n`` is and train/validation scale alike."""
    basis = torch.eye(coarse * coarse).reshape(coarse * coarse, 1, coarse, coarse)
    return _upsample(basis, size).pow(2).sum(dim=0).sqrt()


def _generator(seed: int) -> torch.Generator:
    """A private generator, so building a dataset never moves the global RNG state."""
    return torch.Generator().manual_seed(seed)


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if sizes.get("classes", 2) < 2:
        raise ValueError(f"classes must be at least 2, got {sizes['classes']}.")
