"""A checkpoint saved by any engine at any device count loads into any other and training
continues to the same parameters as an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.checkpoints.format import Checkpoint, load_model_state
from tests import workers
from tests.test_parity_dp import TOLERANCE, relative_error


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_dp4_then_pipeline2_then_hybrid2x2_then_single_equals_uninterrupted(tmp_path, optimizer):
    kind = "gpt"
    reference, reference_losses = workers.train_with("single", kind, optimizer, 1)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    pipeline = {"stages": 2, "micro_batches": 4, "schedule": "1f1b"}
    _, losses_1 = paratrain.launch(
        workers.checkpoint_phase,
        devices=4,
        args=("dp", {}, kind, optimizer, (0, 3), None, a),
    )[0]
    _, losses_2 = paratrain.launch(
        workers.checkpoint_phase,
        devices=2,
        args=("pipeline", pipeline, kind, optimizer, (3, 6), a, b),
    )[0]
    _, losses_3 = paratrain.launch(
        workers.checkpoint_phase,
        devices=4,
        args=("pipeline", {**pipeline, "schedule": "gpipe"}, kind, optimizer, (6, 8), b, c),
    )[0]
    state, losses_4 = workers.checkpoint_phase("single", {}, kind, optimizer, (8, 10), c, None)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses_1 + losses_2 + losses_3 + losses_4 == pytest.approx(
        reference_losses, rel=TOLERANCE
    )
    manifest = Checkpoint(c).manifest
    assert manifest["layout"]["strategy"] == "pipeline" and manifest["layout"]["replicas"] == 2
    assert manifest["step"] == 8
    plain = workers.parity_model(kind)
    plain.load_state_dict(load_model_state(c))  # plain PyTorch, no paratrain engine
    assert all(not name.startswith("module.") for name in plain.state_dict())


@pytest.mark.slow
def test_optimizer_state_is_keyed_by_parameter_name(tmp_path):
    paratrain.launch(
        workers.checkpoint_phase,
        devices=2,
        args=(
            "pipeline",
            {"stages": 2, "micro_batches": 2},
            "mlp",
            "adam",
            (0, 2),
            None,
            str(tmp_path / "ckpt"),
        ),
    )
    checkpoint = Checkpoint(tmp_path / "ckpt")
    names = checkpoint.names("optim")
    assert "1.weight/exp_avg" in names and "5.bias/exp_avg_sq" in names and "1.weight/step" in names
    assert sorted(checkpoint.manifest["files"]) == [
        "model-0.safetensors",
        "model-1.safetensors",
        "optim-0.safetensors",
        "optim-1.safetensors",
        "rng-0.safetensors",
        "rng-1.safetensors",
    ]
    assert torch.equal(checkpoint.tensor("optim", "1.weight/step"), torch.tensor(2.0))


@pytest.mark.slow
def test_dp2_then_zero2x4_then_zero3x2_then_single_equals_uninterrupted(tmp_path):
    """ZeRO's flat slices go out as whole canonical tensors and come back in as slices
    (SGD-momentum here; Adam's chain through zero3 and zero1 is in test_zero.py)."""
    kind, optimizer = "gpt", "sgd"
    reference, reference_losses = workers.train_with("single", kind, optimizer, 1)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    phases = [("dp", 2, (0, 3), None, a), ("zero2", 4, (3, 5), a, b), ("zero3", 2, (5, 8), b, c)]
    losses = []
    for strategy, devices, steps, load_from, save_to in phases:
        losses += paratrain.launch(
            workers.checkpoint_phase,
            devices=devices,
            args=(strategy, {}, kind, optimizer, steps, load_from, save_to),
        )[0][1]
    state, last = workers.checkpoint_phase("single", {}, kind, optimizer, (8, 10), c, None)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses + last == pytest.approx(reference_losses, rel=TOLERANCE)
    assert Checkpoint(c).manifest["layout"]["strategy"] == "zero3"
    assert Checkpoint(c).tensor("optim", "1.attn.qkv.weight/momentum_buffer").shape == (48, 16)


@pytest.mark.slow
def test_zero2_then_tp2_then_tp2x2_then_dp2_then_single_equals_uninterrupted(tmp_path):
    """tp's split layers (gpt's qkv by heads of q, k and v, its MLP, with Adam's moments)
    go out whole and come back in as slices, from and to flat ZeRO slices and replicas,
    at tensor 2 alone and as 2 replicas x 2 tensor."""
    kind, optimizer = "gpt", "adam"
    reference, reference_losses = workers.train_with("single", kind, optimizer, 1)
    a, b, c, d = (str(tmp_path / name) for name in ("a", "b", "c", "d"))
    phases = [
        ("zero2", {}, 2, (0, 3), None, a),
        ("tp", {}, 2, (3, 5), a, b),
        ("tp", {"tensor": 2}, 4, (5, 7), b, c),
        ("dp", {}, 2, (7, 8), c, d),
    ]
    losses = []
    for strategy, options, devices, steps, load_from, save_to in phases:
        losses += paratrain.launch(
            workers.checkpoint_phase,
            devices=devices,
            args=(strategy, options, kind, optimizer, steps, load_from, save_to),
        )[0][1]
    state, last = workers.checkpoint_phase("single", {}, kind, optimizer, (8, 10), d, None)
    assert relative_error(state, reference) <= TOLERANCE
    assert losses + last == pytest.approx(reference_losses, rel=1e-5)
    layout = {"strategy": "tp", "world_size": 4, "tensor": 2, "replicas": 2}
    assert Checkpoint(c).manifest["layout"] == layout
    assert Checkpoint(c).tensor("optim", "1.attn.qkv.weight/exp_avg").shape == (48, 16)
