"""Pipeline partitioning: exact balancing, balance checks, costs, and layer profiling."""

from __future__ import annotations

import random
from fractions import Fraction
from itertools import combinations, pairwise

import pytest
import torch
from torch import nn

from paratrain.parallel.layer_profile import LayerProfile, param_profiles, profile_layers
from paratrain.parallel.pipeline.partition import (
    PartitionError,
    balance_by_cost,
    check_stages,
    layer_costs,
    partition,
    stage_bounds,
    validate_balance,
)

# ---------------------------------------------------------------- balance_by_cost

BALANCES = [
    # (costs, stages, expected balance)
    ([1, 1, 1, 1, 1], 2, [3, 2]),  # tie: the earlier stage takes the extra layer
    ([1, 1, 1, 1, 1], 5, [1, 1, 1, 1, 1]),
    ([1, 1, 1, 1, 1], 1, [5]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 2, 2]),  # 15 | 13 | 17: nothing beats 17
    ([0, 0, 0, 0], 3, [2, 1, 1]),
    ([1, 100, 1, 1], 2, [2, 2]),  # 101 | 2 beats 1 | 102
    ([5, 1, 1, 1, 1, 1], 2, [1, 5]),  # 5 | 5; any longer first stage costs 6
    ([4, 4, 1, 1, 1, 1], 3, [1, 1, 4]),
    ([0.1, 0.2, 0.3], 2, [2, 1]),  # 0.1 + 0.2 > 0.3 exactly, and still the best split
    ([3, 1, 1, 1, 2, 2], 3, [2, 3, 1]),  # 4 | 4 | 2; [2, 2, 2] ties at 4 but is smaller
]


@pytest.mark.parametrize(("costs", "stages", "expected"), BALANCES)
def test_balance_by_cost_exact_table(costs, stages, expected):
    assert balance_by_cost(costs, stages) == expected


def brute_force(costs, stages):
    """Lexicographically largest balance among those with the smallest bottleneck."""
    n = len(costs)
    exact = [Fraction(c) for c in costs]
    best = None
    for cuts in combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        balance = [b - a for a, b in pairwise(edges)]
        worst = max(sum(exact[a:b]) for a, b in pairwise(edges))
        if best is None or (worst, [-x for x in balance]) < (best[0], [-x for x in best[1]]):
            best = (worst, balance)
    return best[1]


def test_balance_by_cost_matches_brute_force():
    rng = random.Random(1234)
    for trial in range(400):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        if trial % 2:
            costs = [rng.randint(0, 6) for _ in range(n)]  # many ties
        else:
            costs = [rng.choice([0.1, 0.2, 0.3, 0.7, 1e-9, 3.5]) for _ in range(n)]
        assert balance_by_cost(costs, stages) == brute_force(costs, stages), (costs, stages)


def test_bad_costs_are_refused():
    with pytest.raises(PartitionError, match="layer 1 has cost -1.0; costs must be finite"):
        balance_by_cost([1.0, -1.0], 1)
    with pytest.raises(PartitionError, match="layer 0 has cost nan"):
        balance_by_cost([float("nan")], 1)
    with pytest.raises(PartitionError, match="layer 0 has cost '3'; costs must be numbers"):
        balance_by_cost(["3"], 1)
    with pytest.raises(PartitionError, match="cannot be split into 4 stages"):
        balance_by_cost([1, 1, 1], 4)


# ---------------------------------------------------------------- checks and bounds


def test_check_stages_says_what_to_change():
    check_stages(3, 3)
    with pytest.raises(PartitionError) as caught:
        check_stages(3, 4)
    assert str(caught.value) == (
        "the model has 3 layers, so it cannot be split into 4 stages; "
        "use at most 3 stages or a model with more layers."
    )
    with pytest.raises(PartitionError, match="the model has 1 layer, so it cannot"):
        check_stages(1, 2)
    with pytest.raises(PartitionError, match="at least 1 stage, not 0"):
        check_stages(3, 0)
    with pytest.raises(PartitionError, match="has 0 layers, so there is nothing to split"):
        check_stages(0, 1)
    assert issubclass(PartitionError, ValueError)


def test_validate_balance_refusals():
    assert validate_balance((2, 4), layers=6, stages=2) == [2, 4]
    with pytest.raises(PartitionError) as caught:
        validate_balance([2, 3], layers=6, stages=2)
    assert str(caught.value) == (
        "balance [2, 3] covers 5 layers but the model has 6; make the entries add up to 6."
    )
    with pytest.raises(PartitionError, match=r"has 3 entries but the pipeline has 2 stages"):
        validate_balance([2, 2, 2], layers=6, stages=2)
    with pytest.raises(PartitionError, match=r"gives stage 1 0 layers; every stage needs"):
        validate_balance([6, 0], layers=6, stages=2)
    with pytest.raises(PartitionError, match=r"has 2.5 for stage 0; every entry must be a whole"):
        validate_balance([2.5, 3.5], layers=6, stages=2)
    with pytest.raises(PartitionError, match="cannot be split into 7 stages"):
        validate_balance([1] * 7, layers=6, stages=7)


def test_stage_bounds():
    assert stage_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]
    assert stage_bounds([4]) == [(0, 4)]


# ---------------------------------------------------------------- costs by choice

PROFILES = [
    LayerProfile(param_count=10, param_bytes=40, forward_backward_s=0.5, activation_bytes=100),
    LayerProfile(param_count=0, param_bytes=0, forward_backward_s=0.25, activation_bytes=300),
    LayerProfile(param_count=30, param_bytes=120, forward_backward_s=0.125, activation_bytes=20),
    LayerProfile(param_count=5, param_bytes=10, forward_backward_s=1.0, activation_bytes=0),
]


def test_layer_costs_per_choice():
    assert layer_costs("params", PROFILES) == [40, 0, 120, 10]
    assert layer_costs("time", PROFILES) == [0.5, 0.25, 0.125, 1.0]
    # 2 x parameter bytes (weights + gradients) + 8 bytes/param (Adam) + activations
    assert layer_costs("memory", PROFILES) == [260.0, 300.0, 500.0, 60.0]
    assert layer_costs("memory", PROFILES, optimizer_bytes_per_param=0) == [180, 300, 260, 20]


def test_partition_by_each_choice():
    assert partition("params", PROFILES, 2) == [2, 2]  # 40 | 130 beats 160 | 10
    assert partition("time", PROFILES, 2) == [3, 1]  # 0.875 | 1.0
    assert partition("memory", PROFILES, 2) == [2, 2]  # 560 | 560
    assert partition("memory", PROFILES, 3) == [2, 1, 1]  # 560 | 500 | 60


def test_partition_refusals():
    with pytest.raises(PartitionError) as caught:
        partition("flops", PROFILES, 2)
    assert str(caught.value) == (
        "unknown partition cost 'flops'; choose one of params, time, memory."
    )
    unmeasured = [LayerProfile(param_count=1, param_bytes=4)] * 3
    assert partition("params", unmeasured, 3) == [1, 1, 1]
    with pytest.raises(PartitionError, match="balancing by 'time' needs measured profiles"):
        partition("time", unmeasured, 2)
    with pytest.raises(PartitionError, match="optimizer_bytes_per_param must be"):
        partition("memory", PROFILES, 2, optimizer_bytes_per_param=-1)
    with pytest.raises(PartitionError, match="4 layers, so it cannot be split into 5 stages"):
        partition("params", PROFILES, 5)


# ---------------------------------------------------------------- layer profiling


def test_param_profiles_count_without_running():
    layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False)]
    assert param_profiles(layers) == [
        LayerProfile(param_count=15, param_bytes=60),
        LayerProfile(param_count=0, param_bytes=0),
        LayerProfile(param_count=6, param_bytes=24),
    ]
    assert not param_profiles(layers)[0].measured


class Square(nn.Module):
    def forward(self, x):
        return x * x  # autograd saves x twice: one storage


def test_profile_layers_measures_saved_activations_per_layer():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False), Square()]
    profiles = profile_layers(layers, torch.randn(5, 4), repeats=2)
    # Linear saves its (5, 4) input, not its weight; ReLU its (5, 3) output; the second
    # Linear its (5, 3) input; Square its (5, 2) input once. float32 throughout.
    assert [p.activation_bytes for p in profiles] == [80, 60, 60, 40]
    assert [(p.param_count, p.param_bytes) for p in profiles] == [(15, 60), (0, 0), (6, 24), (0, 0)]
    assert all(p.measured and p.forward_backward_s > 0 for p in profiles)


def test_profile_layers_accepts_token_ids():
    layers = [nn.Embedding(10, 4), nn.Tanh()]
    profiles = profile_layers(layers, torch.randint(0, 10, (2, 3)), repeats=1)
    # Embedding saves the (2, 3) int64 ids; Tanh its (2, 3, 4) float32 output.
    assert [p.activation_bytes for p in profiles] == [48, 96]
    assert profiles[0].param_count == 40


def test_profile_layers_leaves_the_layers_as_it_found_them():
    torch.manual_seed(0)
    first, norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
    layers = [first, norm, nn.Dropout(0.5), nn.Linear(4, 2)]
    existing = torch.full_like(first.weight, 7.0)
    first.weight.grad = existing
    weights = [p.detach().clone() for p in nn.Sequential(*layers).parameters()]
    running = (norm.running_mean.clone(), norm.running_var.clone())
    sample = torch.randn(8, 4)
    rng = torch.get_rng_state()

    profile_layers(layers, sample)

    assert first.weight.grad is existing and torch.equal(existing, torch.full_like(existing, 7.0))
    assert first.bias.grad is None and layers[3].weight.grad is None
    after = list(nn.Sequential(*layers).parameters())
    assert all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
    assert torch.equal(norm.running_mean, running[0]) and torch.equal(norm.running_var, running[1])
    assert int(norm.num_batches_tracked) == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_layers_refusals():
    with pytest.raises(ValueError, match="repeats must be a positive integer, not 0"):
        profile_layers([nn.ReLU()], torch.randn(2, 2), repeats=0)
    with pytest.raises(TypeError, match="sample_input must be a tensor"):
        profile_layers([nn.ReLU()], [1.0, 2.0])
