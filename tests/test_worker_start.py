"""Workers forked from the launcher's forkserver get what a spawned interpreter had
(``runtime/worker_start.py``): the launcher's environment and standard streams at each
launch, their own random numbers, their arguments' queues; a process the program itself
forks from that server starts fresh too, and a forkserver the program runs of its own
means spawned workers. And they really are forked from the server, which is the point
(a launch that quietly spawned would pass every other test, slowly); a server started
early, as the command line starts it while it prepares a run, is that same server."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain
from paratrain.runtime.worker_start import START_METHOD_ENV
from tests import worker_start_workers as workers

METHODS = [m for m in ("forkserver", "spawn") if m in mp.get_all_start_methods()]


@pytest.mark.parametrize("method", METHODS)
def test_each_launch_gives_its_workers_the_launchers_environment_of_the_moment(monkeypatch, method):
    """The server starts once, with the environment of the first launch; a variable set
    between launches reaches the workers, before the module of their function is
    imported there."""
    monkeypatch.setenv(START_METHOD_ENV, method)
    for mark in ("first", "second"):
        monkeypatch.setenv(workers.MARK, mark)
        assert paratrain.launch(workers.environment_seen, devices=2) == [(mark, mark)] * 2


def test_workers_write_to_the_launchers_stdout_and_stderr_of_the_moment(tmp_path):
    """The server keeps the descriptors the launcher had when it started; a launcher that
    since sent its own elsewhere (here to a file, as pytest's capture does per test) gets
    its workers' output there."""
    paratrain.launch(workers.say_on_both_streams, devices=1, args=("before",))
    log = tmp_path / "log.txt"
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            paratrain.launch(workers.say_on_both_streams, devices=2, args=("logged",))
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    written = sorted(log.read_text().splitlines())
    assert written == ["logged err 0", "logged err 1", "logged out 0", "logged out 1"]


def test_every_worker_of_every_launch_draws_its_own_random_numbers():
    """torch seeds its generator from the OS in each fresh interpreter; forks of one
    server would otherwise all draw the server's numbers."""
    draws = paratrain.launch(workers.random_draws, devices=2)
    draws += paratrain.launch(workers.random_draws, devices=2)
    assert len({tuple(d) for d in draws}) == 4, draws


def test_workers_are_forked_from_one_server_that_outlives_each_launch(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver: workers are spawned")
    first = paratrain.launch(workers.parent_pid, devices=2)
    second = paratrain.launch(workers.parent_pid, devices=2)
    assert len(set(first + second)) == 1 and first[0] != os.getpid(), (first, second)


def test_workers_are_forked_with_torchs_compiler_front_end_loaded(monkeypatch):
    """The server imports ``torch._dynamo`` once, so that a worker's first optimizer
    (``torch.optim.Optimizer.add_param_group`` imports it) costs no import: a launch of 2
    workers that set up dp and stepped once took 1.07 s after the server's start, 0.08 s
    with it loaded."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver: workers are spawned")
    assert paratrain.launch(workers.compiler_loaded, devices=2) == [True, True]


def test_a_process_the_program_forks_from_the_server_starts_as_a_fresh_one_would():
    """Once launch runs the process's forkserver, the program's own forkserver processes
    are forks of it too: SIGTERM has its default action there (the server ignores it),
    and each has a torch seed of its own."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver")
    paratrain.launch(workers.parent_pid, devices=1)
    context = mp.get_context("forkserver")
    queue = context.Queue()
    for _ in range(2):
        process = context.Process(target=workers.report_start_state, args=(queue,))
        process.start()
        process.join(60)
    states = [queue.get(timeout=10) for _ in range(2)]
    assert all(default for default, _ in states) and states[0][1] != states[1][1], states


def _fresh_interpreter(script_text: str, tmp_path: Path, **env: str) -> list[str]:
    """Run ``script_text`` in a fresh interpreter (no forkserver yet), and its stdout lines."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "fresh.py"
    script.write_text(script_text)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    environ.pop(START_METHOD_ENV, None)
    environ.update(env)
    done = subprocess.run(
        [sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_workers_are_spawned_where_the_program_runs_a_forkserver_of_its_own(tmp_path):
    """A forkserver paratrain did not start has unknown preloads and signals: spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver")
    script = (
        "import multiprocessing as mp, os, time\n"
        "import paratrain\n"
        "from tests.worker_start_workers import parent_pid\n"
        "if __name__ == '__main__':\n"
        "    own = mp.get_context('forkserver').Process(target=time.sleep, args=(0,))\n"
        "    own.start(); own.join()\n"
        "    print(paratrain.launch(parent_pid, devices=2) == [os.getpid()] * 2)\n"
    )
    assert _fresh_interpreter(script, tmp_path) == ["True"]


EARLY = (
    "from multiprocessing import forkserver\n"
    "import paratrain\n"
    "from paratrain.runtime.worker_start import start_server_early\n"
    "from tests.worker_start_workers import parent_pid\n"
    "if __name__ == '__main__':\n"
    "    start_server_early()\n"
    "    early = forkserver._forkserver._forkserver_pid\n"
    "    print(early is not None)\n"
    "    print(paratrain.launch(parent_pid, devices=2) == [early] * 2)\n"
)
ARMED = (
    "    from paratrain.runtime.parent_death import LAUNCHER_PID_ENV\n"
    "    mark = f'{LAUNCHER_PID_ENV}={os.getpid()}'.encode()\n"
    "    print(mark in open(f'/proc/{early}/environ', 'rb').read().split(b'\\0'))\n"
)


def test_a_server_started_early_is_the_one_the_launch_forks_from(tmp_path):
    """``start_server_early`` (the command line calls it before loading the data and
    checking the model, so that the server's import of torch runs beside that work) starts
    the very server the next launch forks its workers from, armed as a launch arms it
    (started with the launcher's pid exported, so that it dies with the launcher: read
    from its environment where /proc shows it)."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver")
    if not Path("/proc/self/environ").exists():
        assert _fresh_interpreter(EARLY, tmp_path) == ["True", "True"]
        return
    script = "import os\n" + EARLY + ARMED
    assert _fresh_interpreter(script, tmp_path) == ["True", "True", "True"]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_no_server_starts_early_where_workers_are_spawned_or_the_method_is_refused(
    tmp_path, method
):
    """Under ``spawn`` nothing is started early (the launch spawns, from the launcher);
    an unknown method is not refused early either, but by the launch, in its sentence."""
    script = EARLY.replace("print(paratrain.launch(parent_pid, devices=2) == [early] * 2)", "")
    assert _fresh_interpreter(script, tmp_path, **{START_METHOD_ENV: method}) == ["False"]


PREPARED = (
    "from multiprocessing import forkserver\n"
    "from dataclasses import fields\n"
    "from paratrain.cli.parser import build_parser\n"
    "from paratrain.config import TrainConfig, build_config\n"
    "from paratrain.run import prepare\n"
    "if __name__ == '__main__':\n"
    "    args = build_parser().parse_args(\n"
    "        ['train', '--model', 'mlp', '--dataset', 'synthetic', '--steps', '1'])\n"
    "    config = build_config({}, {f.name: getattr(args, f.name) for f in fields(TrainConfig)})\n"
    "    prepare.prepare_run(config)\n"
    "    print(forkserver._forkserver._forkserver_pid is not None)\n"
)


def test_a_local_run_starts_the_server_while_it_prepares_and_torchrun_does_not(tmp_path):
    """A run this process will launch starts the server in ``prepare_run``; a rank of a
    torchrun job, which launches nothing, does not."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("this platform has no forkserver")
    assert _fresh_interpreter(PREPARED, tmp_path) == ["True"]
    # prepare_run's own step, alone: a whole prepare_run in a job would join its group
    in_job = PREPARED.replace(
        "    prepare.prepare_run(config)\n", "    prepare._start_workers_server()\n"
    )
    assert _fresh_interpreter(in_job, tmp_path, TORCHELASTIC_RUN_ID="job") == ["False"]


def test_spawn_when_asked_for(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert paratrain.launch(workers.parent_pid, devices=2) == [os.getpid()] * 2


def test_a_queue_among_the_arguments_reaches_the_workers():
    """fn and its arguments are pickled by multiprocessing's pickler as the worker starts,
    so what only passes to a starting process (a queue) still does."""
    queue = mp.get_context("spawn").Queue()
    paratrain.launch(workers.put_rank, devices=2, args=(queue,))
    assert sorted(queue.get(timeout=10) for _ in range(2)) == [0, 1]


def test_an_unknown_start_method_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='fork'.*set it to one of"):
        paratrain.launch(workers.parent_pid, devices=2)
