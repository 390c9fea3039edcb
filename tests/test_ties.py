"""Tied weights (the head sharing the embedding's Parameter) under every strategy.

Saved once under the name ``named_parameters()`` gives it, recorded as an alias in the
manifest, restored as one tensor; trained exactly as on one device, also when a pipeline
puts the two tied layers on different stages.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

import paratrain
from paratrain.checkpoints.format import Checkpoint, load_model_state
from paratrain.cli import main
from paratrain.models import build_model, count_parameters, gpt_parameter_count
from tests import tie_workers
from tests.test_parity_dp import TOLERANCE, relative_error

GPT_CANONICAL, GPT_ALIAS = tie_workers.TIES["gpt"]


@pytest.fixture(scope="module")
def references() -> dict:
    return {
        (kind, opt): tie_workers.tied_train("single", kind, opt)
        for kind, opt in itertools.product(tie_workers.KINDS, ("sgd", "adam"))
    }


def test_gpt_ties_the_head_to_the_token_embedding_on_request():
    from paratrain.parallel.ties import tied_names

    options = {"vocab_size": 11, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}
    untied = build_model("gpt", **options)
    tied = build_model("gpt", **options, tie_embeddings=True)
    assert untied[-1].weight is not untied[0].token.weight
    assert tied[-1].weight is tied[0].token.weight
    assert count_parameters(tied) == gpt_parameter_count(**options, tie_embeddings=True)
    assert count_parameters(untied) - count_parameters(tied) == 11 * 16
    assert tied_names(tied) == {"3.weight": "0.token.weight"}
    assert tied_names(untied) == {}


def test_single_saves_a_tie_once_and_loads_it_back_tied(tmp_path, references):
    reference, reference_losses = references[("gpt", "adam")]
    state, losses, _ = tie_workers.tied_checkpoint_phase(
        "single", {}, "gpt", "adam", (0, 4), None, str(tmp_path / "a")
    )
    checkpoint = Checkpoint(tmp_path / "a")
    assert checkpoint.manifest["aliases"] == {"model": {GPT_ALIAS: GPT_CANONICAL}}
    stored = load_file(str(tmp_path / "a" / "model-0.safetensors"))
    assert GPT_CANONICAL in stored and GPT_ALIAS not in stored  # written once
    assert f"{GPT_CANONICAL}/exp_avg" in checkpoint.names("optim")
    assert not any(name.startswith(f"{GPT_ALIAS}/") for name in checkpoint.names("optim"))
    # a plain model state: every key the model has, loadable strictly into a fresh tied model
    plain = load_model_state(tmp_path / "a")
    fresh = tie_workers.tied_model("gpt")
    assert set(plain) == set(fresh.state_dict())
    assert torch.equal(plain[GPT_ALIAS], plain[GPT_CANONICAL])
    fresh.load_state_dict(plain, strict=True)
    assert torch.equal(fresh[-1].weight, state[GPT_CANONICAL])
    # the engine takes it back tied and goes on as an uninterrupted run would
    state, more, tied = tie_workers.tied_checkpoint_phase(
        "single", {}, "gpt", "adam", (4, 10), str(tmp_path / "a"), None
    )
    assert tied
    assert relative_error(state, reference) <= TOLERANCE
    assert losses + more == pytest.approx(reference_losses, rel=TOLERANCE)


def test_ckpt_inspect_and_export_a_tied_checkpoint(tmp_path, capsys):
    tie_workers.tied_checkpoint_phase("single", {}, "gpt", "sgd", (0, 1), None, str(tmp_path / "a"))
    assert main(["ckpt", "inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f"{GPT_ALIAS}" in out and "tied to" in out
    for suffix in ("safetensors", "pt"):
        target = tmp_path / f"model.{suffix}"
        assert main(["ckpt", "export", str(tmp_path / "a"), str(target)]) == 0
        exported = (
            load_file(str(target))
            if suffix == "safetensors"
            else torch.load(target, weights_only=True)
        )
        fresh = tie_workers.tied_model("gpt")
        fresh.load_state_dict(exported, strict=True)
        assert fresh[-1].weight is fresh[0].token.weight
        assert torch.equal(fresh[-1].weight, load_model_state(tmp_path / "a")[GPT_CANONICAL])


def test_a_checkpoint_holding_two_values_for_a_tie_is_refused(tmp_path):
    """An untied model's checkpoint cannot load into the tied model silently."""
    from paratrain.checkpoints.format import CheckpointError

    engine = tie_workers.tied_engine("single", "gpt", "sgd")
    untied = build_model("gpt", vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    from paratrain.checkpoints.format import save_model_state

    save_model_state(tmp_path / "u", {k: v.clone() for k, v in untied.state_dict().items()})
    with pytest.raises(CheckpointError, match="which this model ties"):
        engine.load_checkpoint(tmp_path / "u")


@pytest.mark.slow
def test_dp_then_single_then_dp_with_a_tie_equals_uninterrupted(tmp_path, references):
    """A tied checkpoint saved under dp loads into single and back, optimizer included."""
    reference, reference_losses = references[("gpt", "adam")]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _, losses_1, _ = paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=2,
        args=("dp", {}, "gpt", "adam", (0, 3), None, a),
    )[0]
    _, losses_2, tied = tie_workers.tied_checkpoint_phase("single", {}, "gpt", "adam", (3, 6), a, b)
    assert tied
    results = paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=2,
        args=("dp", {}, "gpt", "adam", (6, 10), b, None),
    )
    state, losses_3, tied = results[0]
    assert all(rank_tied for _, _, rank_tied in results)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses_1 + losses_2 + losses_3 == pytest.approx(reference_losses, rel=TOLERANCE)
    assert Checkpoint(a).manifest["aliases"] == {"model": {GPT_ALIAS: GPT_CANONICAL}}


# -- pipeline: the tie crosses stages -------------------------------------------------------


def check_parity(results, cases, references, label):
    worst = {}
    for case, (state, losses) in zip(cases, results[0], strict=True):
        _, kind, opt, _ = case
        reference, reference_losses = references[(kind, opt)]
        error = relative_error(state, reference)
        worst[(case[0], kind, opt, case[3].get("stages"))] = error
        assert error <= TOLERANCE, f"{label} {case}: relative error {error:.2e}"
        canonical, alias = tie_workers.TIES[kind]
        assert torch.equal(state[canonical], state[alias]), (label, case)  # copies identical
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (label, case)
    print(label, {k: f"{v:.1e}" for k, v in worst.items()})


@pytest.mark.slow
def test_pipeline_keeps_tied_copies_on_two_stages_equal_to_single(references):
    cases = [
        ("pipeline", kind, opt, {"stages": 2, "micro_batches": 4})
        for kind, opt in itertools.product(tie_workers.KINDS, ("sgd", "adam"))
    ]
    results = paratrain.launch(tie_workers.tied_parity_worker, devices=2, args=(cases,))
    check_parity(results, cases, references, "2 stages")


@pytest.mark.slow
def test_pipeline_two_replicas_of_two_stages_with_a_tie_equals_single(references):
    cases = [
        ("pipeline", "gpt", "sgd", {"stages": 2, "micro_batches": 2, "schedule": "gpipe"}),
        ("pipeline", "gpt", "adam", {"stages": 2, "micro_batches": 4}),
        ("pipeline", "plain", "adam", {"stages": 2, "micro_batches": 2, "recompute": True}),
        # the tie spans stages 0 and 3; stages 1 and 2 hold no copy
        ("pipeline", "gpt", "adam", {"stages": 4, "micro_batches": 4, "balance": [1, 1, 1, 2]}),
    ]
    results = paratrain.launch(tie_workers.tied_parity_worker, devices=4, args=(cases,))
    check_parity(results, cases, references, "2 x 2")


@pytest.mark.slow
def test_pipeline_saves_a_tie_once_and_any_strategy_resumes_it(tmp_path, references):
    """single -> pipeline (2 stages) -> pipeline (2 x 2) -> single, with Adam."""
    reference, reference_losses = references[("gpt", "adam")]
    a, b, c = (str(tmp_path / name) for name in "abc")
    _, losses_1, _ = tie_workers.tied_checkpoint_phase("single", {}, "gpt", "adam", (0, 3), None, a)
    _, losses_2, _ = paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=2,
        args=("pipeline", {"stages": 2}, "gpt", "adam", (3, 6), a, b),
    )[0]
    _, losses_3, _ = paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=4,
        args=("pipeline", {"stages": 2, "micro_batches": 2}, "gpt", "adam", (6, 8), b, c),
    )[0]
    state, losses_4, tied = tie_workers.tied_checkpoint_phase(
        "single", {}, "gpt", "adam", (8, 10), c, None
    )
    assert tied
    assert relative_error(state, reference) <= TOLERANCE
    assert losses_1 + losses_2 + losses_3 + losses_4 == pytest.approx(
        reference_losses, rel=TOLERANCE
    )
    for folder in (b, c):
        checkpoint = Checkpoint(folder)
        assert checkpoint.manifest["aliases"] == {"model": {GPT_ALIAS: GPT_CANONICAL}}
        stored = [
            set(load_file(str(checkpoint.directory / name)))
            for name in checkpoint.manifest["files"]
            if name.startswith("model-")
        ]
        assert sum(GPT_CANONICAL in names for names in stored) == 1
        assert not any(GPT_ALIAS in names for names in stored)
        optim = checkpoint.names("optim")
        assert f"{GPT_CANONICAL}/exp_avg" in optim
        assert not any(name.startswith(f"{GPT_ALIAS}/") for name in optim)


# -- ZeRO -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_zero_stages_train_a_tie_as_single_does(references):
    cases = [
        (strategy, kind, opt, {})
        for strategy, kind, opt in itertools.product(
            ("zero1", "zero2", "zero3"), ("gpt", "same_stage"), ("sgd", "adam")
        )
    ]
    results = paratrain.launch(tie_workers.tied_parity_worker, devices=2, args=(cases,))
    check_parity(results, cases, references, "zero")


@pytest.mark.slow
def test_zero_stages_save_a_tie_once_and_reshard(tmp_path, references):
    """zero3 x2 -> zero1 x2 -> zero2 x2 -> single, with Adam."""
    reference, reference_losses = references[("gpt", "adam")]
    a, b, c = (str(tmp_path / name) for name in "abc")
    losses = []
    for strategy, steps, load_from, save_to in (
        ("zero3", (0, 3), None, a),
        ("zero1", (3, 5), a, b),
        ("zero2", (5, 8), b, c),
    ):
        results = paratrain.launch(
            tie_workers.tied_checkpoint_phase,
            devices=2,
            args=(strategy, {}, "gpt", "adam", steps, load_from, save_to),
        )
        assert all(tied for _, _, tied in results), strategy
        losses += results[0][1]
    state, last, tied = tie_workers.tied_checkpoint_phase(
        "single", {}, "gpt", "adam", (8, 10), c, None
    )
    assert tied
    assert relative_error(state, reference) <= TOLERANCE
    assert losses + last == pytest.approx(reference_losses, rel=TOLERANCE)
    for folder in (a, b, c):
        checkpoint = Checkpoint(folder)
        assert checkpoint.manifest["aliases"] == {"model": {GPT_ALIAS: GPT_CANONICAL}}
        assert GPT_ALIAS not in load_file(str(checkpoint.directory / "model-0.safetensors"))


def test_zero3_shards_tied_layers_as_one_unit():
    from paratrain.parallel.zero.units import unit_modules

    model = tie_workers.tied_model("gpt")
    labels = [label for label, _ in unit_modules(model)]
    assert labels == ["0+4", "1", "2", "3"]
    model = tie_workers.tied_model("same_stage")
    assert [label for label, _ in unit_modules(model)] == ["0", "1+3", "5"]


# -- ps ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ps_trains_a_tie_and_saves_it_once(tmp_path, references):
    """Synchronous ps (staleness 0) -> single, and single -> ps, with Adam."""
    reference, reference_losses = references[("gpt", "adam")]
    saved = str(tmp_path / "ps")
    paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=2,
        args=("ps", {"staleness": 0, "servers": 2}, "gpt", "adam", (0, 5), None, saved),
    )
    state, losses, tied = tie_workers.tied_checkpoint_phase(
        "single", {}, "gpt", "adam", (5, 10), saved, None
    )
    assert tied
    assert relative_error(state, reference) <= TOLERANCE
    assert losses == pytest.approx(reference_losses[5:], rel=TOLERANCE)  # ps reports its own share
    checkpoint = Checkpoint(saved)
    assert checkpoint.manifest["aliases"] == {"model": {GPT_ALIAS: GPT_CANONICAL}}
    assert not checkpoint.stored("model", GPT_ALIAS)
    single_saved = str(tmp_path / "single")
    tie_workers.tied_checkpoint_phase("single", {}, "gpt", "adam", (0, 5), None, single_saved)
    results = paratrain.launch(
        tie_workers.tied_checkpoint_phase,
        devices=2,
        args=("ps", {"staleness": 0, "servers": 2}, "gpt", "adam", (5, 10), single_saved, None),
    )
    for state, _, _ in results:
        assert relative_error(state, reference) <= TOLERANCE


def test_a_stage_keeps_its_tied_parameter_when_the_other_copy_goes_to_meta():
    """Under torch's swap-tensors conversion ``Module.to`` converts a Parameter in place,
    which would take the embedding to the meta device along with the head."""
    from paratrain.parallel.pipeline.ties import release_shared

    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = tie_workers.tied_model("plain")
        release_shared(model[3], {id(p) for p in model[0].parameters()})
        model[3].to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert model[0].weight.device.type == "cpu" and model[3].weight.device.type == "meta"
