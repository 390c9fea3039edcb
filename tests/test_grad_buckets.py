"""The bucketed all-reduce launches during backward, in order, and sums exactly.

Two gloo workers run one backward each over a model whose parameters fill several small
buckets, and report which buckets had been handed to gloo when backward returned.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.grad_buckets import BucketedGradientReducer


def _one_backward(bucket_bytes: int) -> dict:
    """One armed backward on rank-dependent data: launch flags before finish, then grads."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
    reducer = BucketedGradientReducer(
        list(model.parameters()), bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes
    )
    reducer.zero_grad()
    reducer.arm(extras=torch.tensor([float(rank + 1)]))
    inputs = torch.full((4, 8), float(rank + 1))
    model(inputs).square().mean().backward()
    launched_in_backward = [bucket.launched for bucket in reducer.buckets]
    extras = reducer.finish(extras_count=1)
    return {
        "launched_in_backward": launched_in_backward,
        "launched_after_finish": [bucket.launched for bucket in reducer.buckets],
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "extras": float(extras[0]),
    }


def _expected_grads() -> dict[str, torch.Tensor]:
    """The sum over both ranks' inputs, computed in one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
    for rank in range(2):
        model(torch.full((4, 8), float(rank + 1))).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return {
        "several": paratrain.launch(_one_backward, devices=2, args=(300,)),
        "one": paratrain.launch(_one_backward, devices=2, args=(1 << 20,)),
    }


def test_buckets_but_the_last_are_all_reduced_during_backward(results):
    for rank in results["several"]:
        flags = rank["launched_in_backward"]
        assert len(flags) >= 3, "the model must span several buckets for this test"
        assert flags[:-1] == [True] * (len(flags) - 1), flags
        assert flags[-1] is False  # the last launches in finish(), see grad_buckets
        assert all(rank["launched_after_finish"])


def test_a_single_bucket_is_launched_by_finish(results):
    for rank in results["one"]:
        assert rank["launched_in_backward"] == [False]
        assert rank["launched_after_finish"] == [True]


@pytest.mark.parametrize("case", ["several", "one"])
def test_the_reduced_gradients_and_extras_are_sums_over_ranks(results, case):
    expected = _expected_grads()
    for rank in results[case]:
        assert rank["extras"] == 3.0
        for name, grad in rank["grads"].items():
            # Exact in principle: both add the same two per-rank gradients (a + b commutes);
            # the bounds (16 fp32 unit roundoffs, atol for entries near zero) allow only
            # a reordered kernel's rounding.
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7)
