"""SIGTERM checkpoints and stops a run that can be resumed; Ctrl-C stops it in one line.

Each test runs ``paratrain train`` as a user would, in its own session, so a signal can
be sent to the launching process alone (a scheduler's SIGTERM to the job's first
process) or to the whole process group (what a terminal does on Ctrl-C).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paratrain.checkpoints.format import Checkpoint
from paratrain.runtime.signals import TerminationNotice
from tests.processes import command, descendants, launched_workers, process_group

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [
    sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--dataset", "synthetic",
    "--devices", "2", "--global-batch", "16", "--log-every", "1",
]  # fmt: skip


def _as_a_terminals_foreground_job() -> None:
    """In the child before it runs: Ctrl-C's SIGINT at its default, as a terminal's
    foreground job has it. An ignored signal stays ignored across exec, and a shell
    without job control (a script's, a CI runner's) starts ``cmd &`` with SIGINT
    ignored: a suite started so would hand that on, and Python, started with SIGINT
    ignored, keeps ignoring it (the launcher then trains on, and the Ctrl-C tests fail
    for the way the suite was started, not for the code)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(arguments: list[str], *, progress: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen(
        [*TRAIN, *([] if progress else ["--no-progress"]), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_as_a_terminals_foreground_job,
    )


def _outcome(process: subprocess.Popen, *, timeout_s: float, after: str) -> tuple[str, str]:
    """The run's output once it exited; a run still going after ``timeout_s`` is killed
    with its whole group (so it cannot hold a core or a port for the tests after) and the
    test fails saying so."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
        raise AssertionError(
            f"paratrain had not exited {timeout_s:.0f} s after {after}; its stderr's end:\n"
            f"{err[-2000:]}"
        ) from None


def _wait_for_training(metrics: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the run has logged a few steps (so the signal lands inside the loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        if metrics.exists():
            kinds = [json.loads(line).get("kind") for line in metrics.read_text().splitlines()]
            if kinds.count("train") >= 3:
                return
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the run logged no training steps in time")


def _gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_sigterm_checkpoints_after_the_current_step_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    process = _start(["--steps", "100000", "--run-dir", str(run)])
    _wait_for_training(run / "metrics.jsonl", process)
    process.send_signal(signal.SIGTERM)  # the launching process only: it forwards
    out, err = _outcome(process, timeout_s=120, after="SIGTERM")
    assert process.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "stopped by SIGTERM" in ln)
    step = int(line.split("after step ")[1].split(";")[0])
    saved = run / "checkpoints" / f"step-{step:08d}"
    assert f"checkpoint {saved}" in line
    assert f"paratrain train --resume {run}" in line
    assert Checkpoint(saved).step == step  # verified: every checksum, the step it names
    assert f", {step} of 100000 steps (stopped by SIGTERM)," in out  # not the 100000 asked
    # The printed command, with only the length changed, continues from that step.
    resumed = _start(["--resume", str(run), "--steps", str(step + 2)])
    out, err = _outcome(resumed, timeout_s=180, after="its start")
    assert resumed.returncode == 0, err[-3000:]
    assert Checkpoint(run / "final").step == step + 2


INTERRUPTED = "paratrain: interrupted; every worker was stopped."


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_ctrl_c_stops_every_process_with_one_line(tmp_path, progress):
    """With the progress bar (the default) too: the line once followed the bar's last
    render on the same line, and a two-line warning about a semaphore the killed worker's
    bar leaked came after it."""
    run = tmp_path / "run"
    process = _start(["--steps", "100000", "--run-dir", str(run)], progress=progress)
    _wait_for_training(run / "metrics.jsonl", process)
    workers = descendants(process.pid)  # the forkserver too, where workers are forked
    assert launched_workers(process.pid), "the launcher started no worker processes"
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    out, err = _outcome(process, timeout_s=60, after="Ctrl-C")
    assert process.returncode == 130
    if progress:  # the bar's renders (redrawn with \r), then the line on a line of its own
        bar = [line for line in err.replace("\r", "\n").splitlines() if line.strip()][:-1]
        assert bar and all(line.startswith("train mlp/dp:") for line in bar), err[-3000:]
        assert err.endswith(f"\n{INTERRUPTED}\n"), err[-3000:]
    else:
        assert err == f"{INTERRUPTED}\n", err[-3000:]
    assert _gone(workers), "a worker process outlived Ctrl-C"


def test_a_worker_told_to_stop_ignores_every_later_sigterm():
    """The launcher's forwarded copy of a preemption's SIGTERM may land after the worker's
    loop, while it checkpoints: from the first SIGTERM on, the signal is ignored, closed
    or not (it once got its default back on close, and the copy killed the worker)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        notice = TerminationNotice()
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line
        assert notice.received
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        notice.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_worker_never_told_to_stop_gets_sigterm_back_on_close():
    def handler(signum, frame) -> None: ...

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        notice = TerminationNotice()
        assert signal.getsignal(signal.SIGTERM) is not handler
        notice.close()
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def _keep_signalling(pids: list[int], stop: threading.Event, every_s: float = 0.02) -> None:
    """SIGTERM each of ``pids`` every ``every_s`` until ``stop`` is set or they are gone."""
    while not stop.wait(every_s):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue


@pytest.mark.slow
def test_no_ps_worker_dies_of_the_launchers_late_copy_of_the_sigterm(tmp_path):
    """A preemption signals every process of the job, and the launcher forwards its own
    SIGTERM to the workers as well; under load that copy lands late, once the workers
    are writing the checkpoint or their report. Both ps workers once died of it there,
    1 run in 10, and the run ended "before the workers could write a checkpoint". Here
    the copy is played as late as can be, again every 20 ms until the job ends: every
    worker must still save and report (on the old code worker 0, which waits seconds for
    its servers to exit, died of it every time)."""
    run = tmp_path / "run"
    process = _start(["--strategy", "ps", "--steps", "100000", "--run-dir", str(run)])
    _wait_for_training(run / "metrics.jsonl", process)
    workers = launched_workers(process.pid)
    assert len(workers) == 2, [command(pid) for pid in descendants(process.pid)]
    os.killpg(process.pid, signal.SIGTERM)
    stop = threading.Event()
    copies = threading.Thread(target=_keep_signalling, args=(workers, stop), daemon=True)
    copies.start()
    try:
        out, err = _outcome(process, timeout_s=120, after="SIGTERM")
    finally:
        stop.set()
        copies.join()
    assert process.returncode == 143, err[-3000:]
    assert "killed by signal" not in err and "goes on without it" not in err, err[-3000:]
    line = next((ln for ln in err.splitlines() if "stopped by SIGTERM after step " in ln), None)
    assert line is not None, err[-3000:]
    step = int(line.split("after step ")[1].split(";")[0])
    assert Checkpoint(run / "checkpoints" / f"step-{step:08d}").step == step


@pytest.mark.slow
def test_sigterm_to_every_process_of_a_ps_job_saves_a_checkpoint(tmp_path):
    """A scheduler's preemption (Slurm, Kubernetes) signals every process of the job, the
    parameter servers too: they hold the parameters and optimizer state, so they must
    serve the workers' checkpoint before they go (they once died of the signal first,
    and the run ended with "stopped by SIGTERM before the workers could write a
    checkpoint"). Nothing may outlive the job either."""
    run = tmp_path / "run"
    process = _start(["--strategy", "ps", "--steps", "100000", "--run-dir", str(run)])
    _wait_for_training(run / "metrics.jsonl", process)
    everyone = process_group(process.pid)
    assert len(everyone) >= 4, "expected the launcher, two workers and a server"
    os.killpg(process.pid, signal.SIGTERM)
    out, err = _outcome(process, timeout_s=120, after="SIGTERM")
    assert process.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "ParameterServerLost" not in err, err[-3000:]
    # It failed once in 23 runs on a loaded machine with no evidence kept: each check
    # below now says what it saw.
    line = next((ln for ln in err.splitlines() if "stopped by SIGTERM" in ln), None)
    assert line is not None and "after step " in line, err[-3000:]
    step = int(line.split("after step ")[1].split(";")[0])
    saved = run / "checkpoints" / f"step-{step:08d}"
    written = sorted(p.name for p in (run / "checkpoints").glob("*"))
    assert f"checkpoint {saved}" in line, (line, written)
    assert Checkpoint(saved).step == step, (line, written)  # verified: checksums, its step
    left = [] if _gone(everyone) else [c for c in map(command, everyone) if c]
    assert not left, f"a process of the job outlived it: {left}"
