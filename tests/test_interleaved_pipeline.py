"""Interleaved 1F1B (``virtual_stages``): each worker holds several non-adjacent chunks.

Parity: the engine runs the same fp32 operations as one device, only the order of the
gradient sums differs (micro-batches and chunks accumulate in another order, replicas
all-reduce), so the suite's fp32 bar ``TOLERANCE`` (1e-5 relative, see
``test_parity_dp``) applies unchanged to states and losses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.layers import LayerPieces
from paratrain.parallel.pipeline.chunks import held_pieces
from paratrain.parallel.pipeline.schedule_clock import simulate
from paratrain.parallel.pipeline.schedules import (
    ScheduleError,
    build_schedule,
    interleaved_1f1b,
    one_f_one_b,
)
from paratrain.parallel.pipeline.ties import layer_list_stages
from tests import workers, zero_bubble_workers
from tests.test_parity_dp import TOLERANCE, relative_error


def test_one_chunk_is_the_plain_schedule_and_gpipe_has_no_interleaved_form():
    assert build_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert build_schedule("1f1b", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    simulate(build_schedule("1f1b", 4, 8, 2))  # raises on a deadlock
    with pytest.raises(ScheduleError, match="virtual stages run the interleaved 1F1B"):
        build_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ScheduleError, match="not a multiple of 2"):
        build_schedule("1f1b", 2, 3, 2)


def test_a_worker_holds_non_adjacent_pieces_under_canonical_names():
    assert held_pieces(1, 2, 3) == [1, 3, 5]
    pieces = LayerPieces((1, 4, 5), "layers.")
    assert pieces.canonical("1.weight") == "layers.4.weight"
    assert pieces.local("layers.5.bias") == "2.bias"
    assert pieces.local("layers.2.bias") is None and pieces.local("head.weight") is None
    state = {"0.w": torch.zeros(1), "2.w": torch.ones(1)}
    assert pieces.from_canonical(pieces.to_canonical(state)) == state


def test_ties_name_the_stage_of_each_piece():
    layers = nn.Sequential(*(nn.Linear(1, 1) for _ in range(4)))
    bounds = [(0, 1), (1, 2), (2, 3), (3, 4)]  # 2 stages x 2 chunks: pieces 0..3
    owners = {name: stage for name, _, stage in layer_list_stages(layers, bounds, "", stages=2)}
    assert [owners[f"{i}.weight"] for i in range(4)] == [0, 1, 0, 1]


def _check(results, cases, *, pieces):
    for case, (state, losses, balance, chunks, reloaded) in zip(cases, results[0], strict=True):
        ref_state, ref_losses = workers.train_with("single", *case)
        assert len(balance) == pieces and chunks == 2, (case, balance, chunks)
        error = relative_error(state, ref_state)
        assert error <= TOLERANCE, f"{case}: relative error {error:.2e}"
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE), case
        initial = workers.parity_model(case[0]).state_dict()
        assert relative_error(reloaded, initial) == 0.0, case  # a single-device state loads


@pytest.mark.slow
def test_interleaved_two_stages_matches_single_device():
    cases = [("mlp", "sgd", 1), ("gpt", "adam", 1), ("gpt", "sgd", 2), ("mlp", "adam", 1)]
    options = [
        {"stages": 2, "virtual_stages": 2, "micro_batches": 4},
        {"stages": 2, "virtual_stages": 2, "micro_batches": 8},
        {"stages": 2, "virtual_stages": 2, "micro_batches": 4},
        {"stages": 2, "virtual_stages": 2, "micro_batches": 2, "recompute": True},
    ]
    loads = [workers.parity_model(kind).state_dict() for kind, _, _ in cases]
    results = paratrain.launch(workers.interleaved_worker, devices=2, args=(cases, options, loads))
    _check(results, cases, pieces=4)


@pytest.mark.slow
def test_interleaved_with_two_replicas_matches_single_device():
    cases = [("gpt", "adam", 1), ("mlp", "sgd", 2)]
    options = [
        {"stages": 2, "virtual_stages": 2, "micro_batches": 4},
        {"stages": 2, "virtual_stages": 2, "micro_batches": 2, "bucket_mb": 0.0005},
    ]
    loads = [workers.parity_model(kind).state_dict() for kind, _, _ in cases]
    results = paratrain.launch(workers.interleaved_worker, devices=4, args=(cases, options, loads))
    _check(results, cases, pieces=4)


@pytest.mark.slow
def test_four_stages_interleaved_and_zb_h1_match_single_device():
    """4 stages: interleaved over 8 pieces of a 10-layer list, and ZB-H1, at 4 and 8
    micro-batches (the schedules' warm-ups differ most from 2 stages' here)."""
    cases = [("deep", "adam", 1), ("deep", "sgd", 1)]
    options = [
        {"stages": 4, "virtual_stages": 2, "micro_batches": 8},
        {"stages": 4, "virtual_stages": 2, "micro_batches": 4},
    ]
    loads = [workers.parity_model(kind).state_dict() for kind, _, _ in cases]
    results = paratrain.launch(workers.interleaved_worker, devices=4, args=(cases, options, loads))
    _check(results, cases, pieces=8)
    runs = [
        ("plain", "gpt", "adam", {"stages": 4, "schedule": "zb-h1", "micro_batches": 4}),
        ("plain", "deep", "sgd", {"stages": 4, "schedule": "zb-h1", "micro_batches": 8}),
    ]
    results = paratrain.launch(zero_bubble_workers.zero_bubble_worker, devices=4, args=(runs,))
    for (_, kind, opt, _), (state, losses, kinds, _) in zip(runs, results[0], strict=True):
        assert kinds == ["backward", "forward", "weight"]
        ref_state, ref_losses = workers.train_with("single", kind, opt, 1)
        assert relative_error(state, ref_state) <= TOLERANCE, kind
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE), kind
