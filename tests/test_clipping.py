"""Gradient clipping by the global norm under every engine equals
``torch.nn.utils.clip_grad_norm_`` in the plain loop: replicas, ZeRO slices, pipeline
stages (a tied weight counted once). ps: tests/test_ps_clipping.py."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, TrainConfig
from paratrain.models import loss_for
from tests import clip_workers, tie_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error


def plain_loop(kind: str, optimizer: str, tie: bool = False) -> tuple[dict, list[float]]:
    model = workers.parity_model(kind)
    opt = workers.parity_optimizer(optimizer)(model.parameters())
    norms = []
    for x, y in workers.parity_batches(kind):
        opt.zero_grad()
        loss_for("gpt" if kind == "gpt" else "mlp")(model(x), y).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_workers.MAX_NORM))
        )
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def plain_loop_tied(kind: str, optimizer: str) -> tuple[dict, list[float]]:
    """The plain loop on a model of ``tests/tie_workers.py``: ``model.parameters()`` yields
    the tied Parameter once, so ``clip_grad_norm_`` counts it once."""
    model = tie_workers.tied_model(kind)
    opt = workers.parity_optimizer(optimizer)(model.parameters())
    norms = []
    for x, y in workers.parity_batches("gpt"):
        opt.zero_grad()
        loss_for("gpt")(model(x), y).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_workers.MAX_NORM))
        )
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def check(result, reference, label) -> None:
    state, norms = result
    error = relative_error(state, reference[0])
    assert error <= TOLERANCE, (label, error)
    # the norm before clipping, summed in another order: a few float32 roundings apart
    assert norms == pytest.approx(reference[1], rel=TOLERANCE), label


def test_the_runs_clip():
    """Guards the tests below: a bound the gradients never reach would test nothing."""
    for kind in ("mlp", "gpt"):
        _, norms = plain_loop(kind, "sgd")
        assert min(norms) > clip_workers.MAX_NORM, kind


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_single_clips_as_the_plain_loop(kind):
    check(clip_workers.train("single", kind, "sgd"), plain_loop(kind, "sgd"), kind)


@pytest.mark.slow
def test_every_engine_clips_by_the_global_norm():
    """Also a head tied to the embedding (``tied-`` kinds): the pipeline holds a copy of the
    weight on each of its two stages (and on each replica at 4 workers), and must count it
    once in the norm and clip both copies alike, as ``clip_grad_norm_`` over
    ``model.parameters()`` does on one device (counting it twice moves the norm by a few
    percent, and so every clipped step)."""
    runs = [
        (strategy, kind, optimizer, options)
        for kind in ("mlp", "gpt")
        for optimizer in ("sgd", "adam")
        for strategy, options in (
            ("dp", {}),
            ("zero1", {}),
            ("zero2", {}),
            ("zero3", {}),
            ("pipeline", {"stages": 2, "micro_batches": 2}),
        )
    ]
    runs += [
        ("pipeline", "tied-gpt", "sgd", {"stages": 2, "micro_batches": 2}),
        ("pipeline", "tied-plain", "adam", {"stages": 2, "micro_batches": 4}),
        ("zero3", "tied-gpt", "adam", {}),
    ]
    references = {(k, o): plain_loop(k, o) for k in ("mlp", "gpt") for o in ("sgd", "adam")}
    references |= {
        (f"tied-{k}", o): plain_loop_tied(k, o) for k in ("gpt", "plain") for o in ("sgd", "adam")
    }
    results = paratrain.launch(clip_workers.train_all, devices=2, args=(runs,))
    for run, result in zip(runs, results[0], strict=True):
        check(result, references[(run[1], run[2])], run)
        if run[1].startswith("tied-"):
            canonical, alias = tie_workers.TIES[run[1].removeprefix("tied-")]
            assert torch.equal(result[0][canonical], result[0][alias]), run
    hybrid = [
        ("pipeline", "gpt", "sgd", {"stages": 2, "micro_batches": 2}),
        ("pipeline", "tied-gpt", "adam", {"stages": 2, "micro_batches": 2}),
    ]
    results = paratrain.launch(clip_workers.train_all, devices=4, args=(hybrid,))
    for run, result in zip(hybrid, results[0], strict=True):
        check(result, references[(run[1], run[2])], ("2 x 2", run))


def test_the_command_line_passes_the_bound_to_the_engine():
    from paratrain.run.build import strategy_options

    config = TrainConfig(model="mlp", strategy="zero2", max_grad_norm=1.5)
    assert strategy_options(config, bundle=None)["max_grad_norm"] == 1.5
    with pytest.raises(ConfigError, match="max_grad_norm must be positive"):
        TrainConfig(max_grad_norm=0.0)
