"""Each worker draws its own dropout masks, reproducibly, and a checkpoint carries them on.

Masks are compared exactly (``torch.equal``): two streams either draw the same bits or not.
Parameters are compared at the suite's bar (``TOLERANCE``, 1e-5 relative): engines that
draw the same masks compute the same function and differ only in the order of fp32 sums.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from tests import norm_workers
from tests.test_parity_dp import TOLERANCE, relative_error

REPLICA_ENGINES = ["dp", "zero1", "zero2", "zero3"]


def same_masks(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def no_mask_shared(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """No mask of ``a`` equals the mask ``b`` drew at the same point (at least 64 draws
    each at p = 0.5: two independent streams agree on one with probability <= 2^-64)."""
    assert len(a) == len(b) and a
    return not any(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_replicas_draw_their_own_masks_the_same_in_every_run():
    """dp and zero1-3 at 2 workers; dp twice, to see that the seed fixes every stream."""
    cases = [("dp", {}), ("dp", {})] + [(name, {}) for name in REPLICA_ENGINES[1:]]
    ranks = paratrain.launch(norm_workers.dropout_runs, devices=2, args=(cases,))
    for (strategy, _), rank0, rank1 in zip(cases, ranks[0], ranks[1], strict=True):
        assert len(rank0["masks"]) == 2 * norm_workers.STEPS
        assert no_mask_shared(rank0["masks"], rank1["masks"]), strategy
    first, again = ranks[0][0], ranks[0][1]
    for rank in ranks:
        dp = rank[0]
        for (strategy, _), run in zip(cases[1:], rank[1:], strict=True):
            # the same streams under every replica engine, hence the same training
            assert same_masks(run["masks"], dp["masks"]), strategy
            assert relative_error(run["state"], dp["state"]) <= TOLERANCE, strategy
    assert first["losses"] == again["losses"]


@pytest.mark.slow
def test_one_worker_draws_what_the_single_device_engine_draws():
    """Rank 0 keeps the stream it was seeded with, so dp on one device equals single."""
    (dp,) = paratrain.launch(norm_workers.dropout_run, devices=1, args=("dp", {}))
    single = norm_workers.dropout_run("single", {})
    assert same_masks(dp["masks"], single["masks"])
    assert relative_error(dp["state"], single["state"]) <= TOLERANCE


@pytest.mark.slow
def test_recompute_replays_the_masks_of_the_forward():
    """Recompute reruns each dropout in backward with the generator state of its forward.

    The recording layers log the replays too: each layer's list alternates its forward's
    mask and the replay of it.
    """
    cases = [("dp", {}), ("dp", {"recompute": True})]
    for plain, recomputed in paratrain.launch(norm_workers.dropout_runs, devices=2, args=(cases,)):
        forwards, replays = recomputed["masks"][0::2], recomputed["masks"][1::2]
        assert same_masks(forwards, plain["masks"])
        assert same_masks(replays, plain["masks"])
        assert relative_error(recomputed["state"], plain["state"]) <= TOLERANCE
        # Exact in principle (the replay reruns the same ops with the same masks): 16 u.
        assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-6)


@pytest.mark.slow
def test_a_resumed_run_continues_every_rank_s_stream(tmp_path):
    """Save after 4 steps, resume in new processes: steps 5-10 draw what an uninterrupted
    run draws on each rank, and end on its parameters."""
    checkpoint = str(tmp_path / "step-4")
    uninterrupted = paratrain.launch(
        norm_workers.uninterrupted_then_saved, devices=2, args=("dp", checkpoint, 4)
    )
    resumed = paratrain.launch(
        norm_workers.dropout_run,
        devices=2,
        args=("dp", {}, (4, norm_workers.STEPS)),
        kwargs={"load_from": checkpoint},
    )
    for whole, second_half in zip(uninterrupted, resumed, strict=True):
        steps, layers = norm_workers.STEPS, 2  # masks come layer by layer, step by step
        later = [
            whole["masks"][layer * steps + step]
            for layer in range(layers)
            for step in range(4, steps)
        ]
        assert same_masks(second_half["masks"], later)
        assert relative_error(second_half["state"], whole["state"]) <= TOLERANCE
    assert no_mask_shared(resumed[0]["masks"], resumed[1]["masks"])


@pytest.mark.slow
def test_a_rank_the_checkpoint_lacks_keeps_a_stream_of_its_own(tmp_path):
    """Saved by one worker, resumed by two: rank 0 continues the saved stream, rank 1
    keeps the one its engine gave it rather than a copy of rank 0's."""
    checkpoint = str(tmp_path / "step-4")
    saved = norm_workers.dropout_run("single", {}, (0, 4), save_to=checkpoint)
    resumed = paratrain.launch(
        norm_workers.dropout_run,
        devices=2,
        args=("dp", {}, (4, norm_workers.STEPS)),
        kwargs={"load_from": checkpoint},
    )
    assert torch.equal(resumed[0]["rng_at_start"], saved["rng_at_end"])
    assert not torch.equal(resumed[1]["rng_at_start"], saved["rng_at_end"])
    assert no_mask_shared(resumed[0]["masks"], resumed[1]["masks"])


@pytest.mark.slow
def test_pipeline_masks_do_not_depend_on_the_schedule_and_differ_across_replicas():
    """2 stages x 2 replicas: GPipe and 1F1B draw the same masks; the two replicas of a
    stage draw different ones."""
    cases = [
        ("pipeline", {"stages": 2, "balance": [3, 4], "schedule": schedule})
        for schedule in ("gpipe", "1f1b")
    ]
    ranks = paratrain.launch(norm_workers.dropout_runs, devices=4, args=(cases,))
    for rank in ranks:
        gpipe, one_f_one_b = rank
        assert gpipe["masks"], "every stage of this model holds a dropout layer"
        assert same_masks(gpipe["masks"], one_f_one_b["masks"])
        # Exact in principle: both schedules run each micro-batch's ops alike and
        # accumulate gradients in micro-batch order 0..m-1 (schedules.py); 16 u.
        assert one_f_one_b["losses"] == pytest.approx(gpipe["losses"], rel=1e-6)
    stages = 2  # rank = replica * stages + stage
    for stage in range(stages):
        replica0, replica1 = ranks[stage][0], ranks[stages + stage][0]
        assert no_mask_shared(replica0["masks"], replica1["masks"]), stage


@pytest.mark.slow
def test_ps_workers_draw_their_own_masks_with_no_message():
    """ps workers never wait on one another: each draws the base from its own generator,
    which gives the streams dp gives (the workers were seeded alike)."""
    cases = [("dp", {}), ("ps", {"staleness": 0})]
    ranks = paratrain.launch(norm_workers.dropout_runs, devices=2, args=(cases,))
    assert no_mask_shared(ranks[0][1]["masks"], ranks[1][1]["masks"])
    for rank in ranks:
        assert same_masks(rank[1]["masks"], rank[0]["masks"])
