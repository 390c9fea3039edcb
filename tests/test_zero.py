"""ZeRO engines: per-worker model-state bytes against the ZeRO formulas, the rest of the
engine contract (eval, load_state_dict, refusals, bytes on the wire), and checkpoints."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoints.format import Checkpoint
from paratrain.models import build_model, count_parameters
from paratrain.parallel.zero.optim import check_sharded_optimizer
from paratrain.parallel.zero.shards import FlatUnit, ZeroLayoutError
from tests import workers, zero_workers
from tests.test_parity_dp import TOLERANCE, low_precision_tolerance, relative_error

GPT = {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
PARAMS = count_parameters(build_model("gpt", **GPT))


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def within(actual: int, expected: float, tolerance: float = 0.05) -> bool:
    return abs(actual - expected) <= tolerance * expected


# -- pure: the flat layout ------------------------------------------------------------------


def test_flat_unit_pads_to_equal_slices_and_views_the_parameters():
    layer = nn.Linear(3, 2)  # 6 + 2 = 8 elements over 3 ranks: 3 each, 1 of padding
    weight = layer.weight.detach().clone()
    unit = FlatUnit("l", list(layer.named_parameters()), rank=1, world=3, own_shard_storage=False)
    assert (unit.numel, unit.shard_numel, unit.padded_numel) == (8, 3, 9)
    assert torch.equal(layer.weight, weight)
    assert layer.weight.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr()
    assert torch.equal(unit.shard, unit.full[3:6])
    with torch.no_grad():
        unit.shard.fill_(7.0)  # the optimizer's writes land in the model (stages 1-2)
    assert torch.equal(layer.weight.flatten()[3:6], torch.full((3,), 7.0))
    assert unit.full[8] == 0


def test_flat_unit_refuses_mixed_dtypes():
    params = [("a", nn.Parameter(torch.ones(2))), ("b", nn.Parameter(torch.ones(2).double()))]
    with pytest.raises(ZeroLayoutError, match="give its parameters one dtype"):
        FlatUnit("u", params, rank=0, world=2, own_shard_storage=True)


# -- refusals before any worker -------------------------------------------------------------


@pytest.mark.parametrize("strategy", zero_workers.STAGES)
def test_zero_outside_a_launched_job_says_what_to_do(strategy):
    with pytest.raises(RuntimeError, match="needs worker processes: call paratrain.setup inside"):
        paratrain.setup(nn.Linear(2, 2), optimizer=adam, loss_fn=F.mse_loss, strategy=strategy)


def test_zero_options_are_checked():
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        paratrain.setup(
            nn.Linear(2, 2), optimizer=adam, loss_fn=F.mse_loss, strategy="zero2", bucket_mb=0
        )
    with pytest.raises(ValueError, match="'zero3' does not take option\\(s\\) bucket_mb"):
        paratrain.setup(
            nn.Linear(2, 2), optimizer=adam, loss_fn=F.mse_loss, strategy="zero3", bucket_mb=1
        )


# -- model-state bytes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_model_state_bytes_follow_the_zero_formulas(devices):
    """fp32 Adam: 4 + 4 + 8 bytes per parameter; stage s shards the first s of
    (optimizer 8, gradients 4, parameters 4) over N. Measured after a train_step."""
    n = devices
    expected = {
        "zero1": {"parameters": 4 * PARAMS, "gradients": 4 * PARAMS, "optimizer": 8 * PARAMS / n},
        "zero2": {
            "parameters": 4 * PARAMS,
            "gradients": 4 * PARAMS / n,
            "optimizer": 8 * PARAMS / n,
        },
        "zero3": {
            "parameters": 4 * PARAMS / n,
            "gradients": 4 * PARAMS / n,
            "optimizer": 8 * PARAMS / n,
        },
    }
    results = paratrain.launch(zero_workers.gpt_state_bytes_worker, devices=n, args=(GPT,))
    for rank, ledgers in enumerate(results):
        for strategy, ledger in ledgers.items():
            for kind, value in expected[strategy].items():
                assert within(ledger[kind], value), (strategy, rank, kind, ledger[kind], value)


# -- the rest of the contract -----------------------------------------------------------------


@pytest.mark.slow
def test_eval_reload_refusal_and_bytes_on_the_wire():
    reference = workers.parity_engine("single", "gpt", "adam")
    x, y = workers.parity_batches("gpt")[0]
    reference.train_step(x, y)
    reference_eval = reference.eval_step(x, y)
    results = paratrain.launch(zero_workers.all_stages_contract_worker, devices=2)
    for rank_results in results:
        for strategy, result in rank_results.items():
            assert result["eval"] == pytest.approx(reference_eval, rel=TOLERANCE), strategy
            assert relative_error(result["state"], reference.state_dict()) <= TOLERANCE
            shifted = {name: tensor + 1.0 for name, tensor in result["state"].items()}
            assert all(torch.equal(result["reloaded"][k], v) for k, v in shifted.items())
            assert "does not split evenly over 2 replica(s)" in result["uneven"], strategy
            padded, shards = result["padded"], result["shards"]
            # reduce-scatter hands over the padded gradient, each all-gather one slice,
            # plus the 4-byte loss and the 4-byte unused-parameter count; zero3 gathers
            # every unit twice (forward and backward)
            gathers = 2 if strategy == "zero3" else 1
            assert result["comm_bytes"] == 4 * padded + gathers * 4 * shards + 8, strategy
            expected_params = 4 * shards if strategy == "zero3" else 4 * padded
            assert result["parameter_bytes"] == expected_params, strategy


# -- checkpoints ------------------------------------------------------------------------------


@pytest.mark.slow
def test_zero_checkpoint_is_canonical_and_reshards(tmp_path):
    """zero3 at 2 workers saves; zero1 at 4 resumes and saves; single finishes: the result
    equals an uninterrupted run, and the files hold whole, named tensors."""
    kind, optimizer = "gpt", "adam"
    reference, reference_losses = workers.train_with("single", kind, optimizer, 1)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _, losses_1 = paratrain.launch(
        workers.checkpoint_phase, devices=2, args=("zero3", {}, kind, optimizer, (0, 4), None, a)
    )[0]
    _, losses_2 = paratrain.launch(
        workers.checkpoint_phase, devices=4, args=("zero1", {}, kind, optimizer, (4, 7), a, b)
    )[0]
    state, losses_3 = workers.checkpoint_phase("single", {}, kind, optimizer, (7, 10), b, None)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses_1 + losses_2 + losses_3 == pytest.approx(reference_losses, rel=TOLERANCE)
    saved = Checkpoint(a)
    model = workers.parity_model(kind)
    assert sorted(saved.names("model")) == sorted(model.state_dict())
    assert saved.tensor("optim", "1.attn.qkv.weight/exp_avg").shape == (48, 16)
    assert torch.equal(saved.tensor("optim", "1.attn.qkv.weight/step"), torch.tensor(4.0))
    assert sorted(saved.manifest["files"]) == [
        "model-0.safetensors",
        "optim-0.safetensors",
        "rng-0.safetensors",
        "rng-1.safetensors",
    ]
    groups = saved.manifest["optimizer"]["param_groups"]
    assert len(groups) == 1 and sorted(groups[0]["params"]) == sorted(
        name for name, _ in model.named_parameters()
    )


# -- mixed precision and the memory ledger ------------------------------------------------------


@pytest.mark.slow
def test_mixed_precision_agrees_with_dp_and_ledger_leaves_out_gathered_parameters():
    """Under fp16 each rank sees only its gradient slices, yet all ranks skip the same
    steps as dp; bf16 trains like dp. Stage 3's saved activations equal stage 2's: the
    parameters it gathers for a layer are not counted as activations."""
    steps = 6
    results = paratrain.launch(zero_workers.precision_worker, devices=2, args=(steps,))
    for rank_results in results:
        for name in ("bf16", "fp16"):
            dp = rank_results[f"dp/{name}"]
            bound = low_precision_tolerance(name, steps)
            if name == "fp16":
                assert dp["skipped"][0] == 1 and dp["skipped"][-1] < 6  # some skip, some step
            for strategy in zero_workers.STAGES:
                ours = rank_results[f"{strategy}/{name}"]
                assert ours["skipped"] == dp["skipped"] and ours["scales"] == dp["scales"]
                error = relative_error(ours["state"], dp["state"])
                assert error <= bound, (strategy, name, error)
                assert ours["losses"] == pytest.approx(dp["losses"], rel=bound)
        peaks = {s: rank_results[f"{s}/bf16"]["activation_peak"] for s in zero_workers.STAGES}
        assert peaks["zero3"] == peaks["zero2"] == peaks["zero1"] > 0, peaks


@pytest.mark.parametrize("strategy", zero_workers.STAGES)
def test_trainer_refuses_an_uneven_batch_before_starting_workers(strategy):
    from paratrain.config import ConfigError, TrainConfig
    from paratrain.run.preflight import check_config

    config = TrainConfig(model="mlp", strategy=strategy, devices=4, global_batch=10)
    with pytest.raises(ConfigError, match="does not split evenly over 4 replica"):
        check_config(config)
    assert check_config(TrainConfig(model="mlp", strategy=strategy, devices=4, global_batch=8)) == 4


# -- optimizers that flat slices would break -----------------------------------------------


def slices() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
        lambda p: torch.optim.Rprop(p),
        lambda p: torch.optim.ASGD(p),
    ],
)
def test_known_elementwise_optimizers_are_accepted(make):
    shards = slices()
    check_sharded_optimizer(make(shards), shards, strategy="zero2", elementwise_optimizer=False)


def test_an_optimizer_not_known_to_be_elementwise_is_refused_unless_vouched_for():
    class ClippingAdam(torch.optim.Adam):  # a subclass may mix elements in step()
        pass

    for make in (lambda p: torch.optim.LBFGS(p), lambda p: ClippingAdam(p)):
        shards = slices()
        optimizer = make(shards)
        with pytest.raises(ValueError, match="is not known to be one; use an elementwise"):
            check_sharded_optimizer(
                optimizer, shards, strategy="zero1", elementwise_optimizer=False
            )
        check_sharded_optimizer(optimizer, shards, strategy="zero1", elementwise_optimizer=True)


def test_optimizer_must_hold_exactly_the_given_slices():
    shards = slices()
    split = torch.optim.Adam([{"params": shards[:1]}, {"params": shards[1:], "lr": 0.1}])
    check_sharded_optimizer(split, shards, strategy="zero3", elementwise_optimizer=True)
    elsewhere = torch.optim.Adam([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match=re.escape("it holds 1 tensor(s) in 1 group(s)")):
        check_sharded_optimizer(elsewhere, shards, strategy="zero3", elementwise_optimizer=True)


@pytest.mark.slow
def test_engines_refuse_such_optimizers_and_take_the_opt_in():
    messages = paratrain.launch(zero_workers.optimizer_refusals_worker, devices=1)[0]
    for strategy in zero_workers.STAGES:
        assert "torch.optim.lbfgs.LBFGS is not known to be one" in messages[f"{strategy}/lbfgs"]
        assert messages[f"{strategy}/lbfgs"].startswith(f"{strategy} updates each worker's")
        assert messages[f"{strategy}/groups"] == "accepted"  # see test_zero_param_groups.py
        assert messages[f"{strategy}/vouched"] == "accepted"
