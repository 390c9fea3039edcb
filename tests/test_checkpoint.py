"""Canonical checkpoints: round trip, atomic replacement, damaged files refused."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.checkpoint import CheckpointError, load_model_state, save_model_state


def sample_state() -> dict[str, torch.Tensor]:
    return {"0.weight": torch.randn(3, 4), "0.bias": torch.arange(3.0), "2.weight": torch.ones(2)}


def test_round_trip_is_exact(tmp_path):
    state = sample_state()
    save_model_state(tmp_path / "ckpt", state, metadata={"step": 7})
    loaded = load_model_state(tmp_path / "ckpt")
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["metadata"] == {"step": 7}


def test_saving_again_replaces_the_folder_and_leaves_no_temporary(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    newer = {"only": torch.zeros(2)}
    save_model_state(tmp_path / "ckpt", newer)
    assert list(load_model_state(tmp_path / "ckpt")) == ["only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_damaged_tensor_file_is_refused(tmp_path):
    save_model_state(tmp_path / "ckpt", sample_state())
    path = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is damaged"):
        load_model_state(tmp_path / "ckpt")


def test_missing_or_foreign_manifest_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a paratrain checkpoint"):
        load_model_state(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match="not a paratrain checkpoint manifest"):
        load_model_state(tmp_path)
