"""A ps checkpoint the disk refuses ends as every engine's does: one sentence, the staging
folder removed, the last complete checkpoint kept, no process left.

ps differs from the other engines in who writes: the parameter servers, in processes of
their own, write the parameters and optimizer state. So their disk's refusal has to
reach the worker that publishes the checkpoint as the ``OSError`` it was (it once came as
a ``RuntimeError`` with the server's words, and the run ended in a 20-line traceback with
``.final.partial`` left holding the space).

The end-to-end case fills a real 6 MiB tmpfs (what the issue's operator did); mounting one
needs root with CAP_SYS_ADMIN, so where the mount is refused that case is skipped, saying
so, and the two cases before it still check both halves without processes.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.checkpoints.format import Checkpoint, CheckpointWriteError, save_model_state
from paratrain.parallel.precision import Precision
from paratrain.parallel.ps.checkpointing import ServerCheckpoints
from paratrain.parallel.ps.protocol import decode_json, encode_json, error_value, reply_error
from tests.processes import process_group

ROOT = Path(__file__).resolve().parents[1]
FULL = os.strerror(errno.ENOSPC)  # "No space left on device"


def test_a_server_s_disk_error_reaches_the_worker_as_the_os_error():
    said = decode_json(encode_json(error_value(0, OSError(errno.ENOSPC, FULL))))
    raised = reply_error(said)
    assert isinstance(raised, OSError) and raised.errno == errno.ENOSPC
    assert raised.strerror == FULL
    assert "parameter server 0" in str(raised.__cause__)  # which server, for the traceback
    other = reply_error(decode_json(encode_json(error_value(1, KeyError("w")))))
    assert type(other) is RuntimeError and str(other) == "parameter server 1: 'w'"


class _FullDiskLink:
    """The servers' side of a save on a full disk: a shard half written into the staging
    folder, then the refusal as the worker's link raises it."""

    def send_json(self, op, values):
        staging = Path(values[0]["staging"])
        (staging / "model-0.safetensors").write_bytes(b"\0" * 1024)
        raise reply_error(error_value(0, OSError(errno.ENOSPC, FULL)))


class _Store(dict):
    """The launch store, as far as the claimant uses it (it posts the folder it writes)."""

    def set(self, key: str, value: str) -> None:
        self[key] = value


class _Claimant(ServerCheckpoints):
    """The worker that claimed the save (what ``ServerCheckpoints`` asks of the engine)."""

    servers, steps_taken, model_config, timeout_s = 1, 4, None, 30.0

    def __init__(self) -> None:
        self.link = _FullDiskLink()
        self.store = _Store()
        self.model = torch.nn.Linear(3, 2)
        self.precision = Precision("fp32")

    def wait_for_bound(self) -> None:
        pass

    def claim(self, what: str) -> tuple[bool, str]:
        return True, f"{what}/1"

    def tied_names(self) -> dict[str, str]:
        return {}

    def layout(self) -> dict:
        return {"strategy": "ps", "world_size": 1}


def test_a_full_disk_while_the_servers_save_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    kept = run / "checkpoints" / "step-00000002"
    weights = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    save_model_state(kept, weights, metadata={"step": 2})
    engine = _Claimant()
    final = run / "final"
    with pytest.raises(CheckpointWriteError) as refused:
        engine.save_checkpoint(final)
    assert str(refused.value) == (
        f"could not save checkpoint {final}: {FULL}; its partial files were removed and the "
        f"last complete checkpoint, {kept}, is kept; free space (or pick a writable "
        "--run-dir) and --resume the run."
    )
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # no .final.partial
    assert Checkpoint(kept).step == 2  # verified against its checksums


def _mount_small_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here ({mounted.stderr.strip()})")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a Linux tmpfs")
@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount command")
def test_ps_on_a_full_tmpfs_says_one_sentence_and_leaves_nothing(tmp_path):
    """A 6 MiB disk takes the step-2 checkpoint (3.9 MiB: mlp's weights and Adam's two
    moments) and refuses the final one."""
    disk = tmp_path / "disk"
    _mount_small_tmpfs(disk, "6m")
    try:
        run = disk / "run"
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        process = subprocess.Popen(
            [sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--dataset",
             "synthetic", "--strategy", "ps", "--devices", "2", "--steps", "4",
             "--checkpoint-every", "2", "--no-progress", "--run-dir", str(run)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        out, err = process.communicate(timeout=300)
        kept = run / "checkpoints" / "step-00000002"
        assert process.returncode == 1, err[-3000:]
        assert err == (
            f"paratrain: could not save checkpoint {run / 'final'}: {FULL}; its partial "
            f"files were removed and the last complete checkpoint, {kept}, is kept; free "
            "space (or pick a writable --run-dir) and --resume the run.\n"
        )
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
        assert Checkpoint(kept).step == 2
        deadline = time.monotonic() + 15
        while process_group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = process_group(process.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, "a process of the job (a worker or the server) outlived it"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
