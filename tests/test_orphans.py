"""Workers die with the process that launched them, even while they are still importing.

A worker left behind by a launcher killed with ``kill -9`` once lived on, reparented and
holding ~230 MB, until its rendezvous timed out (300 s by default): the parent-death
signal was asked for only once torch had loaded. ``runtime/parent_death.py`` arms it on
importing ``paratrain``, before torch, and a worker whose launcher died even earlier
exits as soon as it sees it. Workers forked from the launcher's forkserver
(``runtime/worker_start.py``) die with the server, which dies with the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.runtime.parent_death import EXIT_ORPHANED, LAUNCHER_PID_ENV
from paratrain.runtime.worker_start import START_METHOD_ENV
from tests.processes import command, descendants, launched_workers

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
# The kernel kills the workers when the launcher dies: the bound is only for this test to
# see it (polling /proc on a loaded machine), far below the 300 s they once lived.
GONE_WITHIN_S = 10.0


def _state(pid: int) -> str | None:
    """The process's state letter; None once it no longer exists."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _loading_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _moment_came(launcher: int, moment: str, run: Path) -> bool:
    if moment == "importing torch":  # the spawned workers, or the forkserver for its forks
        return any(_loading_torch(pid) for pid in descendants(launcher))
    return len(launched_workers(launcher)) == 2 and (run / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("moment", ["importing torch", "training"])
def test_kill_9_of_the_launcher_leaves_no_process_of_its_own(tmp_path, method, moment):
    """kill -9 of the launcher while its processes import torch (the spawned workers, or
    the forkserver, which imports it once for the workers it forks) or once its workers
    train: every process below it dies; forked workers through the server, which dies
    with the launcher (a server that lived on would keep them alive, and them it)."""
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--dataset",
         "synthetic", "--devices", "2", "--steps", "100000", "--no-progress",
         "--run-dir", str(run)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**ENV, START_METHOD_ENV: method},
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _moment_came(launcher.pid, moment, run):
            assert launcher.poll() is None, "the launcher ended before the moment came"
            assert time.monotonic() < deadline, f"the launcher was not {moment} in time"
            time.sleep(0.02)
        left = descendants(launcher.pid)
        workers = launched_workers(launcher.pid)
        launcher.kill()  # kill -9: the launcher can stop nobody
        launcher.wait()
        if moment == "importing torch":
            assert not (run / "metrics.jsonl").exists(), "the kill came after training began"
        else:
            assert len(workers) == 2 and set(workers) <= set(left), (workers, left)
        deadline = time.monotonic() + GONE_WITHIN_S
        while time.monotonic() < deadline:
            if all(_state(pid) in (None, "Z") for pid in left):  # a zombie holds no memory
                break
            time.sleep(0.1)
        survivors = [command(pid) for pid in left if _state(pid) not in (None, "Z")]
        assert not survivors, f"{survivors} outlived the launcher"
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # what is left of this test's session
        except ProcessLookupError:
            pass


def _child(launcher_pid: int) -> subprocess.CompletedProcess:
    """A Python process that imports paratrain, told its launcher is ``launcher_pid``."""
    code = f"import os, paratrain; print(os.environ.get({LAUNCHER_PID_ENV!r}, 'unset'))"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**ENV, LAUNCHER_PID_ENV: str(launcher_pid)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_worker_whose_launcher_died_before_it_armed_exits_on_import():
    """The race before the signal is armed: the parent is no longer the launcher named."""
    not_our_parent = os.getppid()  # alive, and not the child's parent
    child = _child(not_our_parent)
    assert child.returncode == EXIT_ORPHANED, child.stderr[-2000:]
    assert child.stdout == ""  # it stopped while importing paratrain


def test_a_worker_whose_launcher_lives_goes_on_and_hides_the_mark_from_its_children():
    child = _child(os.getpid())
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "unset"  # its own children are no launched workers
