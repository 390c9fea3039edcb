"""ZB-H1 in the engine: the backward split into B and W, run by the same runner.

Parity bar: fp32 runs use the suite's ``TOLERANCE`` (1e-5 relative, ``test_parity_dp``):
B and W compute the same products as one backward, only the order of the gradient sums
over micro-batches is the pipeline's, as for 1F1B. Under bf16 the split computes the
same bf16 products as 1F1B on the same saved tensors, so the two schedules are compared
with each other at the same bar (not with one fp32 device, which rounds differently).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import paratrain
from tests import clip_workers, norm_workers, tie_workers, workers, zero_bubble_workers
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
    for (what, kind, opt, options), (state, values, kinds, flush) in zip(
        runs[:8], lead, strict=False
    ):
        assert kinds == ["backward", "forward", "weight"], (what, kind, kinds)
        # clipping's norm and a tie's sum across stages end every step together, so ZB-H1
        # runs its flushed lists there and its lists for steps back to back elsewhere
        spans = what == "clip" or (what, kind) == ("tied", "gpt")
        assert flush == spans, (what, kind, flush)
        if what == "clip":
            ref = clip_workers.train("single", kind, opt)
        elif what == "tied":
            ref = tie_workers.tied_train("single", kind, opt)
        else:
            ref = workers.train_with("single", kind, opt, options.get("accumulation", 1))
        _close(state, values, *ref, f"{what} {kind} {opt}")
    (zb_state, zb_losses, *_), (plain_state, plain_losses, kinds, _) = lead[8], lead[9]
    assert kinds == ["backward", "forward"]
    _close(zb_state, zb_losses, plain_state, plain_losses, "bf16 zb-h1 against bf16 1f1b")


@pytest.mark.slow
def test_zb_h1_with_two_replicas_matches_single_device():
    runs = [
        ("plain", "gpt", "adam", {**ZB, "micro_batches": 4}),
        ("plain", "mlp", "sgd", {**ZB, "micro_batches": 2, "bucket_mb": 0.0005}),
    ]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=4, args=(runs,))
    for (_, kind, opt, _), (state, losses, *_) in zip(runs, results[0], strict=True):
        _close(state, losses, *workers.train_with("single", kind, opt, 1), f"2 x 2 {kind}")


@pytest.mark.slow
def test_zb_h1_s_flushed_lists_at_four_stages_match_single_device_under_clipping():
    """Clipping ends every step together, so the engine runs ZB-H1's flushed lists
    (``PipelineEngine.flush``); at 4 stages, 8 and 4 micro-batches, SGD-momentum and Adam,
    they train as one device does, as the lists for steps back to back do in the tests
    above (the suite's tolerance)."""
    runs = [
        ("clip", "deep", "sgd", {"stages": 4, "schedule": "zb-h1", "micro_batches": 8}),
        ("clip", "gpt", "adam", {"stages": 4, "schedule": "zb-h1", "micro_batches": 4}),
    ]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=4, args=(runs,))
    for (_, kind, opt, _), (state, norms, kinds, flush) in zip(runs, results[0], strict=True):
        assert flush and kinds == ["backward", "forward", "weight"], (kind, flush, kinds)
        _close(state, norms, *clip_workers.train("single", kind, opt), f"4 stages {kind}")


@pytest.mark.slow
def test_zb_h1_runs_its_flushed_lists_on_stages_split_over_a_tensor_group():
    """A stage split over a tensor group keeps ZB-H1's flushed lists
    (``PipelineEngine._step_ends_together``: the planner under-counts such a stage's
    saved bytes, so it holds no more than they do) and trains as one device does."""
    runs = [("plain", "gpt", "adam", {"stages": 2, "tensor": 2, "schedule": "zb-h1"})]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=4, args=(runs,))
    for rank_results in results:
        (state, losses, kinds, flush) = rank_results[0]
        assert flush and kinds == ["backward", "forward", "weight"], (flush, kinds)
    state, losses, _, _ = results[0][0]
    _close(state, losses, *workers.train_with("single", "gpt", "adam", 1), "2 x tensor 2")


def _drawn(masks) -> Counter:
    """How many times each mask was drawn."""
    return Counter(mask.numpy().tobytes() for mask in masks)


@pytest.mark.slow
def test_recompute_replays_each_dropout_mask_under_every_schedule():
    """Layers holding their dropout beside their weights (``norm_workers.
    dropout_blocks_model``: three of Linear, ReLU, dropout, then a Linear head), 2 stages,
    4 micro-batches. With ``recompute`` a zero-bubble schedule reruns each layer of the
    stage fed by another in B and again in W (each of its masks drawn three times, as
    measured), and the first stage's in its W; every rerun must draw the mask its forward
    drew (torch's checkpoint restores the generator), or the weights' gradients would come
    from another mask than the loss did. Each run is compared with the same schedule's
    without recompute: the same masks, each drawn again at least once, and no other. The
    zero-bubble schedules' masks are compared with 1F1B's: each stage's forwards draw in
    micro-batch order under every schedule, so the same masks in the same order and the
    same training. Interleaved holds other layers on each worker (each draws from its own
    stream), so it is compared with itself. Tolerance: the suite's (the same masks and
    products, the gradient sums in each schedule's order)."""
    base = {"stages": 2, "micro_batches": 4, "balance": [2, 2]}
    settings = [
        {**base, "schedule": "1f1b"},
        {**base, "schedule": "zb-h1"},
        {**base, "schedule": "zb-h2"},
        {**base, "schedule": "1f1b", "virtual_stages": 2, "balance": [1, 1, 1, 1]},
    ]
    cases = [("pipeline", {**o, **r}) for o in settings for r in ({}, {"recompute": True})]
    ranks = paratrain.launch(norm_workers.dropout_block_runs, devices=2, args=(cases,))
    for rank, runs in enumerate(ranks):
        onef1b = runs[0]
        for index in range(0, len(cases), 2):
            plain, recomputed = runs[index], runs[index + 1]
            label = f"rank {rank}, {cases[index][1]}"
            drawn, again = _drawn(plain["masks"]), _drawn(recomputed["masks"])
            assert drawn and set(drawn.values()) == {1}, label  # a new mask each forward
            assert again.keys() == drawn.keys(), label  # no other mask
            assert min(again.values()) >= 2, label  # each replayed
            assert relative_error(recomputed["state"], plain["state"]) <= TOLERANCE, label
            assert recomputed["losses"] == pytest.approx(plain["losses"], rel=TOLERANCE), label
            if index in (2, 4):  # ZB-H1, ZB-H2 against 1F1B
                pairs = zip(plain["masks"], onef1b["masks"], strict=True)
                assert all(torch.equal(a, b) for a, b in pairs), label
                assert relative_error(plain["state"], onef1b["state"]) <= TOLERANCE, label
