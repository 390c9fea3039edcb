"""ZeRO stages 1-3 equal the single-device engine (fp32, 10 steps, SGD-momentum and Adam,
with and without gradient accumulation, at 1, 2 and 4 workers)."""

from __future__ import annotations

import itertools

import pytest
import torch

import paratrain
from tests import workers, zero_workers
from tests.test_parity_dp import TOLERANCE, relative_error

CASES = [
    (kind, optimizer, accumulation)
    for kind, optimizer, accumulation in itertools.product(("mlp", "gpt"), ("sgd", "adam"), (1, 2))
]


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: workers.train_with("single", *case) for case in [*CASES, ("unused", "adam", 2)]}


def check(results: list[dict], cases: list[tuple], references: dict, devices: int) -> None:
    for rank_results in results:
        for strategy, runs in rank_results.items():
            for case, (state, losses) in zip(cases, runs, strict=True):
                ref_state, ref_losses = references[case]
                error = relative_error(state, ref_state)
                assert error <= TOLERANCE, (
                    f"{strategy} {case} at {devices} workers: relative error {error:.2e}"
                )
                assert losses == pytest.approx(ref_losses, rel=TOLERANCE), (strategy, case)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_zero_stages_match_single_device(devices, references):
    """Tiny buckets give zero1/2 one unit per parameter, so launch order is exercised."""
    results = paratrain.launch(
        zero_workers.zero_parity_worker,
        devices=devices,
        args=(list(zero_workers.STAGES), CASES, {"bucket_mb": 0.001}),
    )
    check(results, CASES, references, devices)


@pytest.mark.slow
def test_unused_parameter_default_buckets_and_root_parameter(references):
    """A parameter backward never reaches; in zero3 it sits on the root module itself."""
    cases = [("unused", "adam", 2)]
    results = paratrain.launch(
        zero_workers.zero_parity_worker, devices=2, args=(list(zero_workers.STAGES), cases, {})
    )
    check(results, cases, references, 2)
    for runs in results[0].values():
        assert torch.equal(runs[0][0]["never_used"], torch.ones(3))
