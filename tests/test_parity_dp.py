"""dp equals the single-device engine, which equals a hand-written PyTorch loop."""

from __future__ import annotations

import itertools

import pytest
import torch

import paratrain
from paratrain.models import loss_for
from tests import workers

CASES = [
    (kind, optimizer, accumulation)
    for kind, optimizer, accumulation in itertools.product(("mlp", "gpt"), ("sgd", "adam"), (1, 2))
]
TOLERANCE = 1e-5
"""The suite's fp32 parity bar (the project requires 1e-5 relative), for ``relative_error``
of parameters and, relatively, of losses, between engines that run the same fp32
operations and differ only in the order of sums (all-reduce against one device,
buckets, micro-batch accumulation, reduce-scatter of flat shards).

Derivation: reordering a sum of n same-signed terms moves it by at most (n - 1) u with
u = 2^-24 (6e-8), fp32's unit roundoff; a parity batch is 16 samples, so a gradient moves
by at most about 16 u = 1e-6 relative per step. An update at most the size of the
parameters (lr 0.05 SGD, lr 0.01 Adam, whose update is invariant to the gradient's scale)
carries that into the parameters, and the 10 parity steps add up to 10 * 16 u = 9.5e-6,
under 1e-5. Losses are computed from those parameters and move no more (the step-1 loss
is a reordered mean of 16 terms: 16 u). The bound holds on any instruction set, since it
counts roundings, not a kernel's order (measured: 6e-7 and below, see
test_buffer_broadcast.py). A defect (a lost share, a wrong scale) moves them O(1).
This bar is for fp32 only: under bf16/fp16 a reordered fp32 sum can flip a low-precision
rounding, which is what ``low_precision_tolerance`` bounds.
"""

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
"""Half the gap between 1 and the next number in each format (8 and 11 significand bits)."""


def low_precision_tolerance(precision: str, steps: int) -> float:
    """Relative difference allowed between two engines that run the same bf16/fp16 steps
    but reduce in a different fp32 order (all-reduce against reduce-scatter, per-tensor
    against flat optimizer updates).

    Derivation: the fp32 orders differ by about 1e-7 relative, which changes a bf16/fp16
    rounding only for a value that lies that close to a rounding boundary; such a value
    moves by one unit roundoff u of the format, and so does, relatively, the gradient it
    feeds. Adam's update m/(sqrt(v) + eps) is invariant to the gradient's scale, so a
    relative change u in the gradient changes the update by at most u relative, and an
    update is at most the size of the parameters on the parity models (lr 0.01 against
    weights of that order). Each step therefore adds at most u to the relative distance,
    and ``steps`` steps at most ``steps * u``. Which values sit near a boundary depends on
    the CPU's kernels (AVX2 and AVX-512 round bf16 matmuls differently), so this bound,
    not a figure seen on one machine, is what the test can hold every CPU to. A defect
    (a lost gradient share, a wrong averaging factor) flips update signs wholesale and
    lands at O(1).
    """
    return steps * UNIT_ROUNDOFF[precision]


def relative_error(state: dict, reference: dict) -> float:
    """Largest per-tensor relative difference ||a - b|| / ||b||."""
    assert state.keys() == reference.keys()
    worst = 0.0
    for name, expected in reference.items():
        scale = max(expected.norm().item(), 1e-12)
        worst = max(worst, (state[name] - expected).norm().item() / scale)
    return worst


def hand_written_loop(kind: str, optimizer: str, accumulation: int) -> dict:
    """The plain PyTorch loop, as a user would write it."""
    model = workers.parity_model(kind)
    opt = workers.parity_optimizer(optimizer)(model.parameters())
    loss_fn = loss_for("gpt" if kind == "gpt" else "mlp")
    for x, y in workers.parity_batches(kind):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation), strict=True):
            (loss_fn(model(xs), ys) / accumulation).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: workers.train_with("single", *case) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_single_engine_equals_hand_written_loop(case, references):
    state, _ = references[case]
    assert relative_error(state, hand_written_loop(*case)) <= TOLERANCE


def test_parameters_actually_change(references):
    """Guards the parity tests against comparing two untouched models."""
    state, losses = references[("mlp", "adam", 1)]
    initial = workers.parity_model("mlp").state_dict()
    assert relative_error(state, initial) > 1e-2
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_dp_matches_single_device(devices, references):
    results = paratrain.launch(
        workers.dp_parity_worker, devices=devices, args=(CASES, {"first_bucket_mb": 0.001})
    )
    for rank_results in results:
        for case, (state, losses) in zip(CASES, rank_results, strict=True):
            ref_state, ref_losses = references[case]
            error = relative_error(state, ref_state)
            assert error <= TOLERANCE, f"{case} at {devices} workers: relative error {error:.2e}"
            assert losses == pytest.approx(ref_losses, rel=TOLERANCE), case


@pytest.mark.slow
def test_dp_tiny_buckets_and_unused_parameter():
    """Many buckets (launch order matters) and a parameter backward never reaches."""
    cases = [("unused", "adam", 2), ("gpt", "sgd", 1)]
    results = paratrain.launch(
        workers.dp_parity_worker, devices=2, args=(cases, {"bucket_mb": 0.0005})
    )
    for case, (state, losses) in zip(cases, results[0], strict=True):
        ref_state, ref_losses = workers.train_with("single", *case)
        assert relative_error(state, ref_state) <= TOLERANCE, case
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert torch.equal(results[0][0][0]["never_used"], torch.ones(3))
