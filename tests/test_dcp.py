"""PyTorch distributed checkpoints (DCP) in and out: a folder PyTorch wrote from a plain
run (model and Adam state, one process) -> ``paratrain ckpt import`` -> resumed under
single, dp and pipeline as the plain loop continues -> ``ckpt export --format dcp`` ->
``torch.distributed.checkpoint.load`` into a plain model. DCP's pickled ``.metadata`` is
read with an allow-list, never run.

Tolerance: the suite's ``TOLERANCE`` (1e-5 relative per tensor, derived in
tests/test_parity_dp.py): the engines run the plain loop's fp32 operations (Adam's
per-tensor loop, asked for) and differ only in the order of sums (dp's all-reduce of two
replicas' gradients, the pipeline's micro-batches). A resume that lost the optimizer
state (Adam's moments restarted) lands 1e-2 away and more (asserted below as a control).
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import paratrain
from paratrain.checkpoints.format import Checkpoint, CheckpointError
from paratrain.cli import main
from tests import dcp_workers
from tests.dcp_workers import MLP_FLAGS, MORE_STEPS, SAVED_STEPS
from tests.test_parity_dp import TOLERANCE, relative_error


def save_dcp(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder))


def pytorch_folder(tmp_path: Path, form: str) -> Path:
    """The plain run after SAVED_STEPS saved by PyTorch: keyed by name as get_state_dict
    gives it (under FSDP's and torch.compile's wrapper names), or a plain
    optimizer.state_dict() keyed by position."""
    model, optimizer = dcp_workers.plain_run(SAVED_STEPS)
    if form == "named":
        model_state, optim_state = get_state_dict(model, optimizer)
        wrapped = {f"_orig_mod._fsdp_wrapped_module.{k}": v for k, v in model_state.items()}
        optim_state["state"] = {f"module.{k}": v for k, v in optim_state["state"].items()}
        for group in optim_state["param_groups"]:
            group["params"] = [f"module.{name}" for name in group["params"]]
        state = {"model": wrapped, "optim": optim_state}
    else:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    folder = tmp_path / f"dcp-{form}"
    save_dcp(folder, state)
    return folder


def continued_plain_run() -> dict[str, torch.Tensor]:
    model, _ = dcp_workers.plain_run(SAVED_STEPS + MORE_STEPS)
    return model.state_dict()


@pytest.mark.parametrize("form", ["named", "plain"])
def test_a_pytorch_dcp_folder_imports_and_resumes_as_the_plain_loop_continues(
    tmp_path, capsys, form
):
    source = pytorch_folder(tmp_path, form)
    out = tmp_path / "imported"
    assert main(["ckpt", "import", str(source), str(out), *MLP_FLAGS]) == 0
    said = capsys.readouterr().out
    assert "optimizer state carried (exp_avg, exp_avg_sq, step, adam lr 0.01)" in said
    checkpoint = Checkpoint(out)
    assert checkpoint.manifest["optimizer"]["param_groups"][0]["lr"] == 1e-2
    # --resume takes the optimizer that made the state, and refuses another
    assert checkpoint.metadata["config"]["optimizer"] == "adam"
    resumed = dcp_workers.resume("single", str(out), str(tmp_path / "resumed"))
    reference = continued_plain_run()
    assert relative_error(resumed, reference) <= TOLERANCE
    # the control: the same weights with a fresh optimizer land far from the plain loop
    fresh = paratrain.setup(
        dcp_workers.mlp(),
        optimizer=dcp_workers.adam(),
        loss_fn=dcp_workers.loss_fn,
        strategy="single",
    )
    fresh.load_state_dict(checkpoint.model_state())
    for inputs, targets in dcp_workers.batches()[SAVED_STEPS:]:
        fresh.train_step(inputs, targets)
    assert relative_error(fresh.state_dict(), reference) > 1e-2


@pytest.mark.slow
def test_resumed_under_dp_and_pipeline_then_exported_for_dcp_load(tmp_path, capsys):
    source = pytorch_folder(tmp_path, "named")
    imported = tmp_path / "imported"
    assert main(["ckpt", "import", str(source), str(imported), *MLP_FLAGS]) == 0
    reference = continued_plain_run()
    for strategy in ("dp", "pipeline"):
        saved = tmp_path / f"resumed-{strategy}"
        states = paratrain.launch(
            dcp_workers.resume, devices=2, args=(strategy, str(imported), str(saved))
        )
        assert relative_error(states[0], reference) <= TOLERANCE, strategy
        out = tmp_path / f"export-{strategy}"
        assert main(["ckpt", "export", str(saved), "--format", "dcp", str(out)]) == 0
        assert f"wrote {out}: DCP folder of the model and optimizer state" in (
            capsys.readouterr().out
        )
        model = dcp_workers.mlp(seed=9)
        state = model.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(out))
        written = Checkpoint(saved).model_state()
        assert all(torch.equal(state[name], written[name]) for name in written), strategy
        # and the optimizer state, by name, as get_optimizer_state_dict gives it
        back = tmp_path / f"back-{strategy}"
        assert main(["ckpt", "import", str(out), str(back), *MLP_FLAGS]) == 0
        again = Checkpoint(back)
        for key in Checkpoint(saved).names("optim"):
            assert torch.equal(again.tensor("optim", key), Checkpoint(saved).tensor("optim", key))


class Payload:
    """A pickle that, if ever unpickled, makes a folder (the proof that code ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_metadata_pickle_naming_other_code_is_refused_not_run(tmp_path, capsys):
    source = pytorch_folder(tmp_path, "plain")
    marker = tmp_path / "code-ran"
    (source / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert main(["ckpt", "import", str(source), str(tmp_path / "out"), *MLP_FLAGS]) == 2
    error = capsys.readouterr().err
    assert "posix.mkdir, which is not part of a DCP table of contents" in error
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="not part of a DCP table of contents"):
        paratrain.load_model_state(source)
    pickle.loads((source / ".metadata").read_bytes())  # the file really does run code
    assert marker.exists()


class Reach:
    """An allowed class's attribute other than an Enum member, through ``getattr``."""

    def __reduce__(self):
        return (getattr, (Path, "__init__"))


def test_getattr_serves_enum_members_only(tmp_path):
    """Python 3.12 (and Debian's 3.11) pickle an Enum member as getattr(cls, name), which
    DCP's metadata holds (its memory-format encoding); nothing else may use getattr."""
    from paratrain.checkpoints.dcp_read import read_metadata

    folder = pytorch_folder(tmp_path, "plain")
    (folder / ".metadata").write_bytes(pickle.dumps(Reach(), protocol=4))
    with pytest.raises(CheckpointError, match="getattr\\('Path', '__init__'\\), which is not"):
        read_metadata(folder)


def test_position_keyed_optimizer_state_of_another_order_is_refused(tmp_path, capsys):
    model, optimizer = dcp_workers.plain_run(1)
    state = optimizer.state_dict()
    state["param_groups"] = [
        {**state["param_groups"][0], "params": [0, 1]},
        {**state["param_groups"][0], "params": [3, 2]},
    ]
    save_dcp(tmp_path / "dcp", {"model": model.state_dict(), "optim": state})
    assert main(["ckpt", "import", str(tmp_path / "dcp"), str(tmp_path / "out"), *MLP_FLAGS]) == 2
    assert "save get_optimizer_state_dict(model, optimizer), which keys them by name" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_state_imports_with_its_settings_even_when_empty(tmp_path, capsys, momentum):
    """SGD without momentum has no state at all, which DCP saves as no 'state' key."""
    model = dcp_workers.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    inputs, targets = dcp_workers.batches()[0]
    dcp_workers.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    save_dcp(tmp_path / "dcp", {"model": model_state, "optim": optim_state})
    assert main(["ckpt", "import", str(tmp_path / "dcp"), str(tmp_path / "out"), *MLP_FLAGS]) == 0
    config = Checkpoint(tmp_path / "out").metadata["config"]
    assert (config["optimizer"], config["momentum"], config["lr"]) == ("sgd", momentum, 0.1)
    buffers = Checkpoint(tmp_path / "out").names("optim")
    assert len(buffers) == (4 if momentum else 0)
