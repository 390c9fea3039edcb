"""Checkpoint files: round trip, atomic replacement, damaged or foreign files refused."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    load_model_state,
    save_model_state,
    staging_dir,
)


def sample_state() -> dict[str, torch.Tensor]:
    return {"0.weight": torch.randn(3, 4), "0.bias": torch.arange(3.0), "2.weight": torch.ones(2)}


def test_round_trip_is_exact(tmp_path):
    state = sample_state()
    save_model_state(tmp_path / "ckpt", state, metadata={"step": 7})
    loaded = load_model_state(tmp_path / "ckpt")
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["metadata"] == {"step": 7} and manifest["step"] == 7
    assert manifest["files"]["model-0.safetensors"]["kind"] == "model"


def test_saving_again_replaces_the_folder_and_leaves_no_temporary(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    save_model_state(tmp_path / "ckpt", {"only": torch.zeros(2)})
    assert list(load_model_state(tmp_path / "ckpt")) == ["only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_crash_mid_save_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    save_model_state(tmp_path / "ckpt", sample_state())
    import paratrain.checkpoints.format as module

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(module, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        save_model_state(tmp_path / "ckpt", {"new": torch.zeros(1)})
    assert staging_dir(tmp_path / "ckpt").exists()  # the half-written one stays aside
    assert set(load_model_state(tmp_path / "ckpt")) == set(sample_state())


def test_damaged_tensor_file_is_refused_naming_the_file(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / "model-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-0.safetensors is damaged"):
        load_model_state(tmp_path / "ckpt")


def test_truncated_file_is_refused(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / "model-0.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model-0.safetensors is truncated"):
        Checkpoint(tmp_path / "ckpt")


def test_missing_file_and_foreign_or_broken_manifest_are_refused(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    (tmp_path / "ckpt" / "model-0.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-0.safetensors is missing"):
        load_model_state(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="not a paratrain checkpoint"):
        load_model_state(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match="not a paratrain checkpoint manifest"):
        load_model_state(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is damaged"):
        load_model_state(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "paratrain-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match="format version 99"):
        load_model_state(tmp_path)


def test_a_pickle_is_never_loaded(tmp_path):
    """A torch.save file renamed into a checkpoint is refused, not unpickled."""
    save_model_state(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / "model-0.safetensors"
    torch.save(sample_state(), path)
    with pytest.raises(CheckpointError):
        load_model_state(tmp_path / "ckpt")


def test_a_tied_state_is_written_once_and_read_under_every_name(tmp_path):
    """A state dict holding one tensor under two names (tied weights) saves; both read back."""
    from safetensors.torch import load_file
    from torch import nn

    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    save_model_state(tmp_path / "ckpt", model.state_dict())
    assert set(load_file(str(tmp_path / "ckpt" / "model-0.safetensors"))) == {"0.weight"}
    checkpoint = Checkpoint(tmp_path / "ckpt")
    assert checkpoint.manifest["aliases"] == {"model": {"1.weight": "0.weight"}}
    assert checkpoint.names("model") == ["0.weight", "1.weight"]
    state = load_model_state(tmp_path / "ckpt")
    assert state["1.weight"] is state["0.weight"]
    assert torch.equal(state["1.weight"], model[0].weight.detach())
    fresh = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    fresh[1].weight = fresh[0].weight
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh[1].weight, model[0].weight)


def test_an_alias_to_nothing_is_refused(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["aliases"] = {"model": {"9.weight": "missing"}}
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="ties '9.weight' to 'missing'.*damaged"):
        load_model_state(tmp_path / "ckpt")
