"""The run folder: a run already there is refused (or replaced with --overwrite), places
that cannot be written are refused before any worker starts, and a checkpoint the disk
refuses mid-save is one sentence with the last complete checkpoint kept.

Tests run as root here, and root writes through permission bits, so a read-only folder
cannot be made with chmod (and a read-only bind mount needs privileges the tests lack):
the read-only cases patch ``os.access`` to say what ``access(2)`` says of such a folder
to an ordinary user (or of a read-only file system to anyone), which is what the check
asks. A full disk is an ``OSError(ENOSPC)`` raised by the shard writer.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from paratrain.checkpoints.format import Checkpoint, CheckpointError
from paratrain.cli import main
from tests import workers

TRAIN = ["train", "--model", "mlp", "--dataset", "synthetic", "--no-progress", "--devices", "1"]


def _fake_run(folder: Path) -> Path:
    """A folder that holds a run (what a run leaves: metrics.jsonl, final/)."""
    (folder / "final").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    return folder


def _read_only(monkeypatch, *folders: Path) -> None:
    """``os.access`` answering as for an ordinary user: no writing in ``folders``."""
    real = os.access
    refused = [folder.resolve() for folder in folders]

    def access(path, mode, *args, **kwargs):
        inside = any(Path(path).resolve().is_relative_to(f) for f in refused)
        if inside and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_a_folder_holding_a_run_is_refused_naming_resume_and_a_free_name(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    (tmp_path / "run-2").mkdir()  # taken: the free name is the next one
    before = (run / "metrics.jsonl").read_text()
    assert main([*TRAIN, "--steps", "2", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"paratrain: error: {run} already holds a run; pass --resume {run} to continue it, "
        f"--run-dir {tmp_path / 'run-3'} for a new one, or --overwrite to replace it."
    )
    assert (run / "metrics.jsonl").read_text() == before  # nothing appended


def test_overwrite_replaces_the_old_run_whole(tmp_path):
    """The old folder is renamed aside in one step before the new one is made (so a crash
    leaves the old run whole, or none), then removed: nothing of it is left."""
    from paratrain.run.run_folder import check_run_dir, make_run_dir

    run = _fake_run(tmp_path / "run")
    (run / "final" / "model-0.safetensors").write_bytes(b"old")
    check_run_dir(run, resumed_in=None, overwrite=True)
    assert make_run_dir(run, overwrite=True) is True
    assert list(run.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_run_dir_naming_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main([*TRAIN, "--steps", "2", "--run-dir", str(taken)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paratrain: error: --run-dir {taken} is a file, not a folder; pass a folder name "
        f"such as {tmp_path / 'notes.txt-2'}."
    )
    assert taken.read_text() == "mine"


def test_a_fresh_run_under_a_read_only_parent_is_refused(tmp_path, monkeypatch, capsys):
    parent = tmp_path / "shared"
    parent.mkdir()
    _read_only(monkeypatch, parent)
    run = parent / "a" / "run"
    assert main([*TRAIN, "--steps", "2", "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paratrain: error: cannot make the run folder {run}: {parent} is not writable; "
        "pass --run-dir with a folder in a writable place."
    )
    assert list(parent.iterdir()) == []


@pytest.mark.slow
def test_resuming_a_read_only_run_is_refused_before_workers_start(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = (run / "metrics.jsonl").read_text()
    _read_only(monkeypatch, run)
    assert main(["train", "--resume", str(run), "--steps", "4", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paratrain: error: cannot write to {run}, and a resumed run writes its checkpoints "
        f"and metrics into {run}; make it writable, or pass --run-dir with a writable "
        "folder for the resumed run."
    )
    assert (run / "metrics.jsonl").read_text() == before


def test_a_full_disk_while_saving_keeps_the_last_checkpoint_and_leaves_no_partial(
    tmp_path, monkeypatch
):
    import paratrain.parallel.checkpointing as checkpointing

    engine = workers.parity_engine("single", "mlp", "adam")
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    engine.train_step(x, y)
    final = tmp_path / "run" / "final"
    engine.save_checkpoint(final)
    saved = Checkpoint(final).model_state()
    engine.train_step(x, y)
    real = checkpointing.write_shard

    def full_disk(folder, kind, rank, tensors):
        if kind == "optim":  # the model shard was written: a half-written checkpoint
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(folder, kind, rank, tensors)

    monkeypatch.setattr(checkpointing, "write_shard", full_disk)
    with pytest.raises(CheckpointError) as refused:
        engine.save_checkpoint(final)
    assert str(refused.value) == (
        f"could not save checkpoint {final}: No space left on device; its partial files "
        f"were removed and the last complete checkpoint, {final}, is kept; free space (or "
        "pick a writable --run-dir) and --resume the run."
    )
    assert sorted(p.name for p in final.parent.iterdir()) == ["final"]  # no .final.partial
    kept = Checkpoint(final)  # verified against its checksums
    assert kept.step == 1
    assert all(torch.equal(kept.model_state()[k], v) for k, v in saved.items())


def test_a_worker_s_full_disk_is_said_in_one_line(capsys, monkeypatch):
    """What a worker raises reaches the parent as its traceback text; the command line
    prints the sentence alone."""
    import paratrain.cli as cli
    from paratrain.runtime.launch import WorkerError

    sentence = "could not save checkpoint r/final: No space left on device; its partial..."
    details = f"Traceback (most recent call last):\n  ...\nCheckpointWriteError: {sentence}\n"

    def failing(args):
        raise WorkerError(0, details)

    monkeypatch.setattr(cli, "train_command", failing)
    assert main([*TRAIN, "--steps", "2"]) == 1
    assert capsys.readouterr().err.strip() == f"paratrain: {sentence}"


def test_safetensors_disk_errors_are_told_as_the_os_error_they_wrap(tmp_path, monkeypatch):
    """safetensors raises its own error type for a full disk (found on a 6 MiB tmpfs); the
    shard writer makes it the OSError inside, which the save turns into its sentence."""
    from safetensors import SafetensorError

    import paratrain.checkpoints.format as checkpoint_format

    def full(tensors, filename):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(checkpoint_format, "save_file", full)
    with pytest.raises(OSError) as raised:
        checkpoint_format.write_shard(tmp_path, "model", 0, {"w": torch.ones(2)})
    assert raised.value.errno == errno.ENOSPC
