"""ZB-H1 in the engine: the backward split into B and W, run by the same runner.

Parity bar: fp32 runs use the suite's ``TOLERANCE`` (1e-5 relative, ``test_parity_dp``):
B and W compute the same products as one backward, only the order of the gradient sums
over micro-batches is the pipeline's, as for 1F1B. Under bf16 the split computes the
same bf16 products as 1F1B on the same saved tensors, so the two schedules are compared
with each other at the same bar (not with one fp32 device, which rounds differently).
"""

from __future__ import annotations

import pytest

import paratrain
from tests import clip_workers, tie_workers, workers, zero_bubble_workers
from tests.test_parity_dp import TOLERANCE, relative_error

ZB = {"stages": 2, "schedule": "zb-h1"}


def _close(state, values, ref_state, ref_values, label):
    error = relative_error(state, ref_state)
    assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"
    assert values == pytest.approx(ref_values, rel=TOLERANCE), label


@pytest.mark.slow
def test_zb_h1_matches_single_device_with_clipping_ties_accumulation_and_bf16():
    runs = [
        ("plain", "mlp", "sgd", {**ZB, "micro_batches": 4}),
        ("plain", "gpt", "adam", {**ZB, "micro_batches": 8}),
        ("plain", "gpt", "sgd", {**ZB, "micro_batches": 4, "accumulation": 2}),
        ("clip", "mlp", "adam", {**ZB, "micro_batches": 4}),
        ("tied", "gpt", "adam", {**ZB, "micro_batches": 4}),
        ("tied", "same_stage", "sgd", {**ZB, "micro_batches": 4}),
        ("plain", "gpt", "adam", {**ZB, "micro_batches": 4, "recompute": True}),
        (
            "plain",
            "mlp",
            "sgd",
            {"stages": 2, "schedule": "zb-h2", "micro_batches": 4, "recompute": True},
        ),
        ("plain", "gpt", "adam", {**ZB, "micro_batches": 4, "precision": "bf16"}),
        ("plain", "gpt", "adam", {"stages": 2, "micro_batches": 4, "precision": "bf16"}),
    ]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=2, args=(runs,))
    lead = results[0]
    for (what, kind, opt, options), (state, values, kinds) in zip(runs[:8], lead, strict=False):
        assert kinds == ["backward", "forward", "weight"], (what, kind, kinds)
        if what == "clip":
            ref = clip_workers.train("single", kind, opt)
        elif what == "tied":
            ref = tie_workers.tied_train("single", kind, opt)
        else:
            ref = workers.train_with("single", kind, opt, options.get("accumulation", 1))
        _close(state, values, *ref, f"{what} {kind} {opt}")
    (zb_state, zb_losses, _), (plain_state, plain_losses, kinds) = lead[8], lead[9]
    assert kinds == ["backward", "forward"]
    _close(zb_state, zb_losses, plain_state, plain_losses, "bf16 zb-h1 against bf16 1f1b")


@pytest.mark.slow
def test_zb_h1_with_two_replicas_matches_single_device():
    runs = [
        ("plain", "gpt", "adam", {**ZB, "micro_batches": 4}),
        ("plain", "mlp", "sgd", {**ZB, "micro_batches": 2, "bucket_mb": 0.0005}),
    ]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=4, args=(runs,))
    for (_, kind, opt, _), (state, losses, _) in zip(runs, results[0], strict=True):
        _close(state, losses, *workers.train_with("single", kind, opt, 1), f"2 x 2 {kind}")
