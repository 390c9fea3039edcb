"""``paratrain ckpt export --format hf``: Hugging Face models trained under zero2 on 2
workers, exported, load with ``from_pretrained`` (the Auto class, as a user would) with
no missing or unexpected key and the trained weights exactly (the export copies tensors:
no arithmetic, so equality is exact); a model without a ``config`` exports its weights
and the command says that no config.json was written."""

from __future__ import annotations

import io
import json
import logging
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import paratrain
from paratrain.checkpoints.format import save_model_state
from paratrain.checkpoints.hf_export import INDEX, shard_plan
from paratrain.cli import main
from tests import hf_workers

pytest.importorskip("transformers", reason="the dev extra installs transformers")


def test_shards_are_cut_in_order_with_an_oversized_tensor_alone():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 7}
    assert shard_plan(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert shard_plan(sizes, 100) == [["a", "b", "c", "d", "e"]]


def test_a_model_without_a_config_exports_its_weights_and_says_so(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    save_model_state(tmp_path / "ckpt", model.state_dict())
    export = ["ckpt", "export", str(tmp_path / "ckpt"), "--format", "hf", str(tmp_path / "hf")]
    assert main(export) == 0
    assert (
        main(["ckpt", "export", str(tmp_path / "ckpt"), "--format", "hf", str(tmp_path / "hf")])
        == 2
    )
    said = capsys.readouterr()
    assert "no config.json was written: the model saved no `config`" in said.out
    assert "already exists and is not an empty folder" in said.err  # the second export
    assert main([*export[:-1], str(tmp_path / "other"), "--max-shard-size", "5G"]) == 2
    assert "--max-shard-size must be a size such as" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@contextmanager
def loading_messages():
    """Everything transformers logs or warns while loading, as one text."""
    from transformers.utils import logging as hf_logging

    text = io.StringIO()
    handler = logging.StreamHandler(text)
    logger = logging.getLogger("transformers")
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield text
        finally:
            logger.removeHandler(handler)
            hf_logging.set_verbosity(previous)
            text.write("".join(str(w.message) for w in caught))


def from_pretrained(folder: Path):
    from transformers import AutoModelForCausalLM

    with loading_messages() as messages:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model, info, messages.getvalue()


@pytest.mark.slow
def test_zero2_trained_models_load_with_from_pretrained_and_no_key_warning(tmp_path, capsys):
    runs = [("zero2", kind, "adam", 1, {}) for kind in ("gpt2", "llama")]
    results = paratrain.launch(hf_workers.train_and_save, devices=2, args=(runs, str(tmp_path)))
    for (_, kind, *_), (trained, _, path) in zip(runs, results[0], strict=True):
        out = tmp_path / f"{kind}-hf"
        # GPT-2 in shards of at most 20 KB (its tensors are 0.1-8 KiB), the Llama in one file
        sharding = ["--max-shard-size", "20KB"] if kind == "gpt2" else []
        assert main(["ckpt", "export", path, "--format", "hf", str(out), *sharding]) == 0
        said = capsys.readouterr().out
        files = sorted(p.name for p in out.iterdir())
        if kind == "gpt2":
            assert INDEX in files and "model-00001-of-" in files[1]
            assert "1 tied name(s) stored once" in said
            assert "lm_head.weight" not in json.loads((out / INDEX).read_text())["weight_map"]
        else:
            assert files == ["config.json", "model.safetensors"]
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [type(hf_workers.build(kind)).__name__]
        model, info, messages = from_pretrained(out)
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        assert "missing" not in messages.lower() and "unexpected" not in messages.lower(), messages
        loaded = model.state_dict()
        assert set(loaded) == set(trained)
        assert all(torch.equal(loaded[name], trained[name]) for name in trained), kind
    # the control: a folder lacking a tensor is reported, so the silence above means something
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "llama-hf", broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    _, info, messages = from_pretrained(broken)
    assert "model.norm.weight" in info["missing_keys"] and "model.norm.weight" in messages
