"""recompute=True for whole-model engines: same results, fewer activations in the ledger."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.recompute import segments
from tests import mem_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error

CASES = [("gpt", "adam", "parity"), ("mlp", "sgd", "parity")]


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return mem_workers.run_cases("single", [(case, {}) for case in CASES])


def test_single_recompute_changes_nothing_but_the_activations(plain):
    recomputed = mem_workers.run_cases("single", [(case, {"recompute": True}) for case in CASES])
    for case, ref, got in zip(CASES, plain, recomputed, strict=True):
        assert relative_error(got["state"], ref["state"]) <= TOLERANCE, case
        # Exact in principle: recompute reruns the same forward ops on the same bits; 1e-6
        # (16 fp32 unit roundoffs) allows nothing beyond rounding.
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    gpt_plain, gpt_recomputed = plain[0]["memory"]["peak"], recomputed[0]["memory"]["peak"]
    assert gpt_recomputed["activations"] < 0.3 * gpt_plain["activations"]
    assert gpt_recomputed["parameters"] == gpt_plain["parameters"]


def test_segments_start_at_each_layer_with_parameters():
    relu, linear = nn.ReLU(), nn.Linear(2, 2)
    layers = nn.Sequential(nn.Flatten(), linear, relu, nn.Linear(2, 2), nn.Linear(2, 2), relu)
    lengths = [len(part) for part in segments(layers)]
    assert lengths == [1, 2, 1, 2]


def test_recompute_refuses_batchnorm_models():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="running statistics of BatchNorm layer '1' twice"):
        paratrain.setup(
            model,
            optimizer=workers.parity_optimizer("sgd"),
            loss_fn=nn.functional.cross_entropy,
            strategy="single",
            recompute=True,
        )


def test_recompute_needs_a_layer_list():
    with pytest.raises(ValueError, match="is not a layer list"):
        paratrain.setup(
            nn.Linear(4, 2),
            optimizer=workers.parity_optimizer("sgd"),
            loss_fn=nn.functional.mse_loss,
            strategy="single",
            recompute=True,
        )


@pytest.mark.slow
def test_dp_recompute_matches_single_and_holds_fewer_activations(plain):
    cases = [(case, {"recompute": flag}) for case in CASES for flag in (True, False)]
    ranks = paratrain.launch(mem_workers.run_cases, devices=2, args=("dp", cases))
    for rank in ranks:
        for index, case in enumerate(CASES):
            recomputed, stored = rank[2 * index], rank[2 * index + 1]
            error = relative_error(recomputed["state"], plain[index]["state"])
            assert error <= TOLERANCE, f"{case}: relative error {error:.2e}"
            assert recomputed["losses"] == pytest.approx(plain[index]["losses"], rel=TOLERANCE)
            assert torch.equal(
                torch.tensor(recomputed["losses"]), torch.tensor(stored["losses"])
            ), "recompute must not change the arithmetic"
            peak_on, peak_off = recomputed["memory"]["peak"], stored["memory"]["peak"]
            if case[0] == "gpt":  # blocks save much more than their input
                assert peak_on["activations"] < 0.5 * peak_off["activations"], peak_on
            else:  # the mlp saves little beyond each linear's input: never more
                assert peak_on["activations"] <= peak_off["activations"], peak_on
            assert peak_on["gradients"] == peak_off["gradients"]
