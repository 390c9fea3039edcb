"""Weights saved elsewhere (DataParallel/DDP ``module.`` names, torch.compile's
``_orig_mod.``, safetensors, nested training dicts) load into a plain model, become a
paratrain checkpoint with ``ckpt import``, and never run pickled code; checkpoint files
get the user's umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import paratrain
from paratrain.checkpoints.format import Checkpoint, CheckpointError, save_model_state
from paratrain.cli import main
from paratrain.models import build_model
from paratrain.parallel.ties import tied_names

MLP_FLAGS = ["--model", "mlp", "--dataset", "synthetic", "--hidden", "16", "--depth", "1"]


def mlp() -> torch.nn.Module:
    """The model MLP_FLAGS describe (synthetic data: 784 inputs, 10 classes)."""
    torch.manual_seed(0)
    return build_model("mlp", in_features=784, hidden=16, depth=1, classes=10)


def prefixed(state: dict, prefix: str) -> dict:
    return {prefix + name: tensor for name, tensor in state.items()}


@pytest.mark.parametrize("prefix", ["module.", "module.module.", "_orig_mod.", "module._orig_mod."])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".safetensors"])
def test_a_wrapped_models_file_loads_into_the_plain_model(tmp_path, prefix, suffix):
    source = mlp().state_dict()
    path = tmp_path / f"model{suffix}"
    wrapped = prefixed(source, prefix)
    save_file(wrapped, str(path)) if suffix == ".safetensors" else torch.save(wrapped, path)
    assert set(paratrain.load_model_state(path)) == set(wrapped)  # without a model: as stored
    model = build_model("mlp", in_features=784, hidden=16, depth=1, classes=10)
    model.load_state_dict(paratrain.load_model_state(path, model=model), strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, source[name])


def test_wrapper_segments_inside_names_are_stripped():
    from paratrain.checkpoints.model_state import strip_wrappers

    assert strip_wrappers("encoder._fsdp_wrapped_module.layer.weight") == "encoder.layer.weight"
    assert strip_wrappers("module.block._checkpoint_wrapped_module.w") == "block.w"
    # a module the user named "module" (not leading) is theirs, and so is a leaf
    assert strip_wrappers("a.module.b") == "a.module.b" and strip_wrappers("module") == "module"


def test_a_training_dict_with_the_state_under_a_key_is_read(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "model_state_dict": prefixed(mlp().state_dict(), "module.")}, path)
    model = mlp()
    model.load_state_dict(paratrain.load_model_state(path, model=model), strict=True)


class Payload:
    """A pickle that, if ever unpickled, makes a folder (the proof that code ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_pickled_object_is_refused_not_executed(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="never unpickles") as caught:
        paratrain.load_model_state(path)
    assert "\n" not in str(caught.value) and not marker.exists()
    torch.load(path, weights_only=False)  # the file really does run code when unpickled
    assert marker.exists()


def test_a_mismatch_names_the_first_missing_and_unexpected_and_the_prefix(tmp_path):
    model = mlp()
    path = tmp_path / "lightning.pt"
    torch.save(prefixed(model.state_dict(), "model."), path)  # not a wrapper: not stripped
    with pytest.raises(CheckpointError) as caught:
        paratrain.load_model_state(path, model=model)
    message = str(caught.value)
    assert "missing '1.bias' and 3 more, unexpected 'model.1.bias' and 3 more" in message
    assert "every name in the file starts with 'model.', which the model's names lack" in message
    torch.save(model.state_dict(), path)
    wrapped = torch.nn.DataParallel(mlp())
    with pytest.raises(CheckpointError, match="every name of the model starts with 'module.'"):
        paratrain.load_model_state(path, model=wrapped)
    smaller = build_model("mlp", in_features=784, hidden=8, depth=1, classes=10)
    with pytest.raises(CheckpointError, match="holds '1.weight' of shape \\(16, 784\\), but"):
        paratrain.load_model_state(path, model=smaller)


def test_a_run_folder_means_its_newest_checkpoint(tmp_path):
    old = mlp().state_dict()
    torch.manual_seed(1)
    new = build_model("mlp", in_features=784, hidden=16, depth=1, classes=10).state_dict()
    save_model_state(tmp_path / "run" / "checkpoints" / "step-00000002", old, metadata={"step": 2})
    save_model_state(tmp_path / "run" / "final", new, metadata={"step": 4})
    loaded = paratrain.load_model_state(tmp_path / "run")
    assert all(torch.equal(loaded[name], new[name]) for name in new)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoints_and_exports_get_the_users_umask(tmp_path, umask, capsys):
    """Before the fix, safetensors shards were 0600 whatever the umask."""
    previous = os.umask(umask)
    try:
        checkpoint = save_model_state(tmp_path / "ckpt", mlp().state_dict())
        assert main(["ckpt", "export", str(checkpoint), str(tmp_path / "out.safetensors")]) == 0
    finally:
        os.umask(previous)
    capsys.readouterr()
    files = [*checkpoint.iterdir(), tmp_path / "out.safetensors"]
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in files}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_ckpt_import_makes_a_checkpoint_the_resume_reads(tmp_path, capsys):
    source = mlp().state_dict()
    path = tmp_path / "model.pt"
    torch.save(prefixed({k: v.half() for k, v in source.items()}, "module."), path)
    out = tmp_path / "imported"
    assert main(["ckpt", "import", str(path), str(out), *MLP_FLAGS]) == 0
    said = capsys.readouterr().out
    assert "('module.1.bias' read as '1.bias', ...)" in said
    assert "the optimizer starts fresh" in said
    checkpoint = Checkpoint(out)
    assert checkpoint.step == 0 and checkpoint.manifest["optimizer"] is None
    assert checkpoint.metadata["config"]["hidden"] == 16
    state = checkpoint.model_state()
    assert all(state[k].dtype == torch.float32 for k in state)  # the model's dtype
    assert all(torch.equal(state[k], source[k].half().float()) for k in source)
    assert (
        main(["ckpt", "import", str(path), str(tmp_path / "bad"), *MLP_FLAGS, "--hidden=32"]) == 2
    )
    assert "holds '1.weight' of shape (16, 784), but the model's is (32, 784)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [["--strategy", "zero3"], ["--strategy", "pipeline", "--stages", "2"], ["--strategy", "ps"]],
)
def test_an_imported_checkpoint_resumes_under_any_strategy(tmp_path, capsys, strategy):
    """One SGD step at lr 1e-9 moves each weight by lr * |gradient| (gradients of this
    model on this data are O(1)), about 1e-9, well under the 1e-6 asserted; a run that did
    not start from the imported weights would differ from them by the initialisation's
    O(0.01-0.1)."""
    path = tmp_path / "model.pt"
    torch.manual_seed(1)  # not the seed paratrain would initialise with
    source = build_model("mlp", in_features=784, hidden=16, depth=1, classes=10).state_dict()
    torch.save(prefixed(source, "module."), path)
    out = tmp_path / "imported"
    assert main(["ckpt", "import", str(path), str(out), *MLP_FLAGS]) == 0
    flags = ["--steps", "1", "--optimizer", "sgd", "--lr", "1e-9", "--devices", "2"]
    flags += ["--no-progress", "--eval-every", "0", "--global-batch", "8", *strategy]
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--run-dir", str(tmp_path / "run"), *flags]) == 0
    assert f"resuming from {out} at step 0 (imported from {path}" in capsys.readouterr().err
    trained = Checkpoint(tmp_path / "run" / "final").model_state()
    # One SGD step at lr 1e-9 moves a weight by 1e-9 x |gradient| (gradients are O(1) on
    # this model): under 1e-8, a hundredth of the bound, which in turn is far below the
    # weights' scale (init ~ 1/sqrt(784) = 0.036).
    assert max((trained[k] - source[k]).abs().max().item() for k in source) < 1e-6


def test_a_tied_name_the_file_stores_once_is_filled_in(tmp_path):
    """safetensors (and Hugging Face) files keep a shared tensor under one name only."""
    torch.manual_seed(0)
    options = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = build_model("gpt", **options, tie_embeddings=True)
    state = model.state_dict()
    aliases = tied_names(model)
    assert aliases  # the head's weight is the token embedding's
    path = tmp_path / "tied.safetensors"
    save_file({k: v.clone() for k, v in state.items() if k not in aliases}, str(path))
    fresh = build_model("gpt", **options, tie_embeddings=True)
    fresh.load_state_dict(paratrain.load_model_state(path, model=fresh), strict=True)
    assert all(torch.equal(fresh.state_dict()[k], state[k]) for k in state)


def test_importing_a_paratrain_checkpoint_takes_its_model_settings(tmp_path, capsys):
    """The way to continue a run's weights with a fresh optimizer (another --lr)."""
    config = {"model": "mlp", "dataset": "synthetic", "hidden": 16, "depth": 1, "lr": 0.01}
    run = save_model_state(
        tmp_path / "run" / "final", mlp().state_dict(), metadata={"config": config}
    )
    assert main(["ckpt", "import", str(tmp_path / "run"), str(tmp_path / "fresh")]) == 0
    capsys.readouterr()
    saved = Checkpoint(tmp_path / "fresh").metadata
    assert saved["config"]["hidden"] == 16 and "lr" not in saved["config"]
    assert saved["imported_from"] == str(tmp_path / "run") and run.exists()
