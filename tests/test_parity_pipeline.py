"""The pipeline engine equals the single-device engine: stages, schedules, micro-batches."""

from __future__ import annotations

import itertools

import pytest

import paratrain
from tests import workers
from tests.test_parity_dp import TOLERANCE, relative_error

KINDS, OPTIMIZERS = ("mlp", "gpt"), ("sgd", "adam")
MICRO, SCHEDULES = (1, 4, 8), ("gpipe", "1f1b")


@pytest.fixture(scope="module")
def references() -> dict:
    return {
        (kind, opt, acc): workers.train_with("single", kind, opt, acc)
        for kind, opt, acc in itertools.product(KINDS, OPTIMIZERS, (1, 2))
    }


def check(results, cases, references, label):
    """Rank 0 holds the full canonical state; every rank reports the same losses."""
    for case, (state, losses) in zip(cases, results[0], strict=True):
        ref_state, ref_losses = references[case]
        error = relative_error(state, ref_state)
        assert error <= TOLERANCE, f"{label} {case}: relative error {error:.2e}"
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE), (label, case)
    for rank_results in results[1:]:
        for (_, losses), (_, lead_losses) in zip(rank_results, results[0], strict=True):
            assert losses == lead_losses


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_matches_single_device(stages, references):
    grid = list(itertools.product(KINDS, OPTIMIZERS, MICRO, SCHEDULES))
    cases = [(kind, opt, 1) for kind, opt, _, _ in grid]
    options = [
        {"stages": stages, "micro_batches": micro, "schedule": schedule}
        for _, _, micro, schedule in grid
    ]
    results = paratrain.launch(
        workers.pipeline_parity_worker, devices=stages, args=(cases, options)
    )
    check(results, cases, references, f"{stages} stages")


@pytest.mark.slow
def test_hybrid_two_replicas_of_two_stages_and_recompute_and_accumulation(references):
    cases = [
        ("mlp", "adam", 1),
        ("gpt", "sgd", 1),
        ("gpt", "adam", 2),
        ("mlp", "sgd", 2),
        ("gpt", "adam", 1),
    ]
    options = [
        {"stages": 2, "micro_batches": 4, "schedule": "1f1b"},
        {"stages": 2, "micro_batches": 2, "schedule": "gpipe"},
        {"stages": 2, "micro_batches": 2, "schedule": "1f1b", "recompute": True},
        {"stages": 2, "micro_batches": 4, "schedule": "gpipe", "bucket_mb": 0.0005},
        {"stages": 4, "micro_batches": 4, "schedule": "1f1b", "balance": [1, 1, 1, 2]},
    ]
    results = paratrain.launch(workers.pipeline_parity_worker, devices=4, args=(cases, options))
    check(results, cases, references, "2 x 2 hybrid")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_pipeline_on_gloos_messages_matches_single_device(monkeypatch, references, schedule):
    """The suite's CPU pipelines move their messages through shared memory (``local_p2p``);
    ``PARATRAIN_P2P=gloo`` keeps them on gloo, the transport between hosts and on GPUs'
    CPU fallback, which must stay exact too."""
    monkeypatch.setenv("PARATRAIN_P2P", "gloo")
    cases = [("mlp", "adam", 1), ("gpt", "sgd", 1)]
    options = [{"stages": 2, "micro_batches": 4, "schedule": schedule}] * 2
    results = paratrain.launch(workers.pipeline_parity_worker, devices=2, args=(cases, options))
    check(results, cases, references, f"gloo {schedule}")
