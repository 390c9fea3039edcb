"""Elastic dp: a worker dies (killed, or its step raises) and the run loses no step.

The pure tests cover the pieces (the refusals, the fault plan, the record, the launcher's
referee); three launches cover the whole path: two kills in one run (4 -> 3 -> 2 workers,
in forward and during the all-reduce), a kill in the optimizer step plus a crash of the
lead worker, and a kill that leaves fewer than ``--min-devices``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest
import torch.distributed as dist

from paratrain.checkpoints.format import Checkpoint, load_model_state
from paratrain.cli import main
from paratrain.config import ConfigError, TrainConfig
from paratrain.run.elastic import Change, generation_to_join
from paratrain.run.elastic_checks import check_elastic
from paratrain.run.faults import PHASES, Fault, planned_faults
from paratrain.runtime.elastic import (
    ElasticReferee,
    ElasticTerms,
    Generation,
    Post,
    admit,
    await_admission,
    gather,
    is_communication_error,
    latest_generation,
    mark_elastic,
    next_generation,
    post_members,
    read_post,
)
from paratrain.runtime.worker_start import START_METHOD_ENV
from tests.readme_examples import example_env
from tests.test_parity_dp import relative_error
from tests.test_torchrun import _free_port

STEPS = 6
GLOBAL_BATCH = 24  # splits evenly over 2, 3 and 4 workers
TOLERANCE = STEPS * GLOBAL_BATCH * 2.0**-24
"""Final weights of a run that lost workers against the uninterrupted 4-worker run: 8.6e-6.

Derivation (as ``test_parity_dp.TOLERANCE``): both runs take the same global batches and
the same fp32 operations; only the split changes (24 rows over 3 or 2 replicas instead of
4), which reorders the sum of the 24 per-sample gradient terms and scales the shares by
1/3 or 1/2 instead of 1/4. Reordering a sum of n terms moves it by at most (n - 1) u,
u = 2^-24, so a step's gradient moves by at most 24 u relative; Adam's update is invariant
to the gradient's scale and at most the size of the parameters (lr 3e-3), so each step
adds at most 24 u to the parameters' relative distance, and 6 steps at most 6 * 24 u. A
lost or doubled share, a skipped step or a step taken twice moves them O(lr) = 1e-3.
"""

BASE = [
    "train",
    "--no-progress",
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--hidden",
    "32",
    "--depth",
    "1",
    "--strategy",
    "dp",
    "--global-batch",
    str(GLOBAL_BATCH),
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--steps",
    str(STEPS),
    "--timeout",
    "60",
    "--bucket-mb",
    "0.001",  # a bucket per tensor: the earlier buckets are in flight when the last is ready
]


def train(run_dir: Path, *flags: str) -> int:
    base = BASE[:-2] if "zero3" in flags else BASE  # zero3 gathers by units, not buckets
    return main([*base, "--run-dir", str(run_dir), *flags])


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("elastic") / "whole"
    assert train(run_dir, "--devices", "4") == 0
    return load_model_state(run_dir / "final")


@pytest.mark.slow
def test_two_kills_in_forward_and_all_reduce_lose_no_step(tmp_path, monkeypatch, uninterrupted):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:2:2:forward,kill:1:4:allreduce")
    run_dir = tmp_path / "two"
    assert train(run_dir, "--devices", "4", "--elastic", "--min-devices", "2") == 0
    changes = records(run_dir, "workers")
    assert [(c["step"], c["old_workers"], c["new_workers"]) for c in changes] == [
        (2, 4, 3),
        (4, 3, 2),
    ]
    assert [c["lost_ranks"] for c in changes] == [[2], [1]]
    assert [c["steps_redone"] for c in changes] == [1, 1]  # both died before any step ended
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
def test_a_kill_in_the_optimizer_step_and_a_crash_of_the_lead(
    tmp_path, monkeypatch, uninterrupted, capfd
):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:3:2:optimizer,crash:0:4:backward")
    run_dir = tmp_path / "lead"
    assert train(run_dir, "--devices", "4", "--elastic", "--min-devices", "2") == 0
    changes = records(run_dir, "workers")
    # worker 3 died after every all-reduce of step 2: the others had finished step 2
    assert [(c["step"], c["steps_redone"], c["lost_ranks"]) for c in changes] == [
        (2, 0, [3]),
        (4, 1, [0]),
    ]
    assert "injected crash at step 4 (backward)" in capfd.readouterr().err  # its own stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    stamps = [json.loads(line)["time_s"] for line in lines]
    assert stamps == sorted(stamps)  # the new lead's records stamp on from the run's start
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_replacement_joins_and_the_run_ends_at_four_workers(
    tmp_path, monkeypatch, uninterrupted, capfd, method
):
    """Worker 1 dies in step 2; the launcher starts worker 4 (--max-restarts 1); worker 0
    holds step 4 until worker 4 is ready, so it joins at a boundary after step 2 (the
    redone step) and no later than after step 4. A spawned replacement imports torch
    first, and is never ready before the hold: it joins after step 4, the hold waited
    for it. A forked one is ready in milliseconds and may join earlier."""
    monkeypatch.setenv(START_METHOD_ENV, method)
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:2:forward,hold:0:4")
    run_dir = tmp_path / "grow"
    flags = ("--devices", "4", "--elastic", "--min-devices", "2", "--max-restarts", "1")
    assert train(run_dir, *flags) == 0
    changes = records(run_dir, "workers")
    assert [(c["old_workers"], c["new_workers"]) for c in changes] == [(4, 3), (3, 4)]
    lost, joined = (c["step"] for c in changes)
    assert lost == 2 and (joined == 4 if method == "spawn" else 2 <= joined <= 4), joined
    assert [(c["lost_ranks"], c["joined_ranks"]) for c in changes] == [([1], []), ([], [4])]
    assert [c["steps_redone"] for c in changes] == [1, 0]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    assert len(records(run_dir, "memory")) == 4  # the memory records of the final group
    out = capfd.readouterr()
    assert (
        f"worker 4 joined after step {joined}; 4 workers go on (3 before) (no step redone"
        in out.err + out.out
    )
    assert "mlp on synthetic, strategy dp, 4 -> 3 -> 4 worker(s)" in out.out
    assert "  workers           4 at the start, 4 at the end; step 2: 4 -> 3 (lost 1;" in out.out
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_kill_at_a_random_point_loses_no_step(tmp_path, monkeypatch, uninterrupted, seed):
    """The kill's phase, rank and step drawn from a seeded RNG (seed 0: allreduce, rank 3,
    step 1; 1: forward, the lead, step 3; 2: start, the lead, step 1): wherever it lands,
    3 workers go on and the final weights equal the uninterrupted run's."""
    draw = random.Random(seed)
    phase, rank, step = draw.choice(PHASES), draw.randrange(4), draw.randint(1, STEPS)
    monkeypatch.setenv("PARATRAIN_FAULT", f"kill:{rank}:{step}:{phase}")
    run_dir = tmp_path / f"seed{seed}"
    assert train(run_dir, "--devices", "4", "--elastic", "--min-devices", "2") == 0
    changes = records(run_dir, "workers")
    assert [(c["step"], c["new_workers"], c["lost_ranks"]) for c in changes] == [(step, 3, [rank])]
    # the optimizer phase comes after every all-reduce: the others had finished the step
    assert changes[0]["steps_redone"] == (0 if phase == "optimizer" else 1)
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_goes_on_from_the_newest_checkpoint_at_the_survivors_count(
    tmp_path, monkeypatch, uninterrupted, capfd, strategy
):
    """zero1-3 keep each optimizer shard (zero3: each parameter shard too) once: worker 1's
    death in step 5 takes its shard, so the 3 survivors restart from step 4's checkpoint and
    compute step 5 again. Against the dp run: the same derivation (only the order of the
    per-sample sums differs)."""
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:5:forward")
    run_dir = tmp_path / strategy
    flags = ("--strategy", strategy, "--devices", "4", "--elastic", "--min-devices", "2")
    assert train(run_dir, *flags, "--checkpoint-every", "2") == 0
    out = capfd.readouterr()
    assert (
        f"paratrain: worker 1 lost; {strategy} keeps state that no survivor holds, so the 3 "
        f"survivors restart from checkpoint {run_dir / 'checkpoints' / 'step-00000004'} (step 4)."
    ) in out.err
    assert f"strategy {strategy}, 4 -> 3 worker(s)" in out.out
    changes = records(run_dir, "workers")
    assert [(c["step"], c["old_workers"], c["new_workers"]) for c in changes] == [(5, 4, 3)]
    assert [(c["lost_ranks"], c["steps_redone"]) for c in changes] == [([1], 1)]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
def test_a_lost_torchrun_node_restarts_the_job_smaller_from_the_newest_checkpoint(
    tmp_path, uninterrupted
):
    """Two torchrun "nodes" (one process each, c10d rendezvous on 127.0.0.1, --nnodes 1:2,
    --max-restarts 1); node 1 is lost (agent and worker SIGKILLed) at the start of step 5.
    The agent of node 0 restarts the job at one process, and paratrain resumes it from the
    newest checkpoint (step 4) with no flag added; weights as the uninterrupted run's."""
    port = str(_free_port())
    run_dir = tmp_path / "torchrun"
    flags = [*BASE[1:], "--run-dir", str(run_dir), "--checkpoint-every", "2"]
    flags += ["--timeout", "300"]  # each node's group waits for the other's slow start

    def node(host: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
            "--rdzv-conf", f"is_host={host},last_call_timeout=20,join_timeout=300",
            "-m", "paratrain", "train", *flags,
        ]  # fmt: skip

    lost_env = {**example_env(), "PARATRAIN_FAULT": "node:0:5,node:1:5"}  # whichever rank
    host = subprocess.Popen(node(1), env=example_env(), stdout=PIPE, stderr=PIPE, text=True)
    lost = subprocess.Popen(node(0), env=lost_env, stdout=PIPE, stderr=PIPE, text=True)
    try:
        _, err = host.communicate(timeout=500)
        lost.wait(timeout=60)
    finally:
        host.kill()
        lost.kill()
    assert host.returncode == 0, err[-4000:]
    assert lost.returncode == -signal.SIGKILL
    newest = run_dir / "checkpoints" / "step-00000004"
    assert f"restart 1 by torchrun; resuming from the newest checkpoint, {newest}." in err
    configs = records(run_dir, "config")
    assert [(c["workers"], c["start_step"]) for c in configs] == [(2, 0), (1, 4)]
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
def test_fewer_than_min_devices_ends_with_one_sentence_and_the_last_step_saved(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:3:forward")
    run_dir = tmp_path / "short"
    assert train(run_dir, "--devices", "2", "--elastic", "--min-devices", "2") == 1
    err = capsys.readouterr().err
    assert "fewer than --min-devices 2; the last completed step (2) is saved" in err
    assert "Traceback" not in err.split("paratrain: worker(s)")[-1]
    assert Checkpoint(run_dir / "checkpoints" / "step-00000002").step == 2


def config(**changes) -> TrainConfig:
    return TrainConfig(**{"model": "mlp", "dataset": "synthetic", "strategy": "dp", **changes})


@pytest.mark.parametrize(
    ("changes", "devices", "words"),
    [
        ({"elastic": True, "strategy": "ps"}, 4, "zero3 only: under ps"),
        ({"elastic": True, "strategy": "pipeline"}, 4, "zero3 only: under pipeline"),
        ({"elastic": True, "global_batch": 32, "min_devices": 2}, 4, "split evenly over 3"),
        ({"elastic": True, "min_devices": 5, "global_batch": 60}, 4, "between 1 and the 4"),
        ({"elastic": True, "precision": "fp16", "global_batch": 12}, 4, "loss scale"),
        ({"min_devices": 2}, 4, "add --elastic"),
    ],
)
def test_what_elastic_cannot_do_exactly_is_refused_in_one_sentence(changes, devices, words):
    with pytest.raises(ConfigError, match=words) as refused:
        check_elastic(config(**changes), devices)
    assert str(refused.value).count(". ") == 0 and str(refused.value).endswith(".")


def test_a_batch_that_splits_over_every_count_is_accepted():
    check_elastic(config(elastic=True, global_batch=24, min_devices=2), 4)
    check_elastic(config(elastic=True, global_batch=12, gradient_accumulation=2), 2)


def test_faults_name_a_launch_rank_a_step_and_a_phase(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:3:forward, crash:0:2, kill:1:5")
    assert planned_faults(attempt=0) == [
        Fault("kill", 1, 3, "forward"),
        Fault("kill", 1, 5, "start"),
    ]
    assert planned_faults(attempt=1) == []  # a restart runs clean
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:3:start:1")
    assert planned_faults(attempt=1) == [Fault("kill", 1, 3, "start")]
    monkeypatch.setenv("PARATRAIN_FAULT", "hold:1:4,node:1:5")
    assert planned_faults(attempt=0) == [Fault("hold", 1, 4, "start"), Fault("node", 1, 5, "start")]
    monkeypatch.setenv("PARATRAIN_FAULT", "hold:1:4:forward")  # it waits before a step only
    with pytest.raises(ValueError, match=r"kind:rank:step\[:phase\[:attempt\]\]"):
        planned_faults(attempt=0)
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:3:sideways")
    with pytest.raises(ValueError, match=r"kind:rank:step\[:phase\[:attempt\]\]"):
        planned_faults(attempt=0)


def test_a_change_of_worker_count_is_one_record_and_one_line():
    change = Change(step=7, old=4, new=3, lost=(2,), seconds_lost=1.2345, steps_redone=1)
    assert change.record() == {
        "step": 7,
        "old_workers": 4,
        "new_workers": 3,
        "lost_ranks": [2],
        "joined_ranks": [],
        "seconds_lost": 1.234,
        "steps_redone": 1,
    }
    assert change.line() == (
        "paratrain: worker 2 lost in step 7; 3 of 4 workers go on (step 7 redone, 1.23 s lost)."
    )
    joined = Change(step=9, old=3, new=4, lost=(), seconds_lost=0.5, steps_redone=0, joined=(4,))
    assert joined.record()["joined_ranks"] == [4]
    assert joined.line() == (
        "paratrain: worker 4 joined after step 9; 4 workers go on (3 before) "
        "(no step redone, 0.50 s lost)."
    )


def test_the_referee_posts_each_generation_and_stops_below_the_minimum(capsys):
    store = dist.HashStore()
    referee = ElasticReferee(world_size=3)
    failures = {1: "worker process 1 was killed by signal SIGKILL (no traceback)."}
    lost: dict[int, str] = {}
    referee.settle(store, {1}, failures, lost)  # not elastic: a failure stays a failure
    assert failures and not lost
    mark_elastic(store, ElasticTerms(min_devices=2))
    referee.settle(store, {1}, failures, lost)
    assert not failures and set(lost) == {1}
    assert read_post(store, 1) == Post((0, 2))
    assert not referee.stopping
    failures = {0: "worker process 0 exited with code 1 without a result."}
    referee.settle(store, {0}, failures, lost)
    assert read_post(store, 2) == Post((2,))
    assert referee.stopping
    err = capsys.readouterr().err
    assert "2 worker(s) remain; they go on." in err
    assert "1 worker(s) remain; fewer than the minimum 2 are left" in err


def test_the_referee_replaces_the_dead_within_the_budget_and_the_group_admits_them():
    """Two deaths, one replacement allowed: one worker is started (launch rank 4, after
    every survivor), announced in the survivors' post; once the group has admitted it in
    generation 2, a later shrink keeps it; one never admitted is stopped at the end."""
    store = dist.HashStore()
    started: list[int] = []
    referee = ElasticReferee(world_size=4, spawn=started.append)
    mark_elastic(store, ElasticTerms(min_devices=2, replacements=1))
    lost: dict[int, str] = {}
    referee.settle(store, {1}, {1: "killed."}, lost)
    assert started == [4] and read_post(store, 1) == Post((0, 2, 3), joining=(4,))
    assert latest_generation(store) == 1
    number = next_generation(store)  # what the lead does at a boundary (run/elastic)
    admit(store, number, Post((0, 2, 3, 4)), newcomers=[4])
    assert await_admission(store, 4, timeout_s=1.0) == 2
    referee.settle(store, {2}, {2: "killed."}, lost)
    assert started == [4]  # the one replacement allowed is spent
    assert read_post(store, 3) == Post((0, 3, 4))
    assert referee.unneeded(store, finished={0, 3}) == set()

    store = dist.HashStore()
    referee = ElasticReferee(world_size=2, spawn=lambda rank: None)
    mark_elastic(store, ElasticTerms(min_devices=1, replacements=1))
    referee.settle(store, {1}, {1: "killed."}, {})
    assert referee.unneeded(store, finished=set()) == set()  # the group still runs
    assert referee.unneeded(store, finished={0}) == {2}  # it ended before 2 joined


def test_only_a_failed_collective_is_a_peers_death():
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert is_communication_error(reset)
    assert not is_communication_error(RuntimeError("injected crash at step 4 (backward)"))
    assert not is_communication_error(ValueError("Connection reset, but not a collective"))


def test_elastic_on_gpu_workers_is_refused_until_it_has_run_there(monkeypatch):
    """Rebuilding a group after a death has run over gloo only; a GPU job (NCCL) is told
    which flag gets it the tested path, before any worker starts."""
    from paratrain.config import ConfigError, TrainConfig
    from paratrain.run import elastic_checks

    monkeypatch.setattr(elastic_checks, "resolve_backend", lambda backend, devices: "nccl")
    config = TrainConfig(strategy="dp", elastic=True, min_devices=2, global_batch=24)
    with pytest.raises(ConfigError, match="add --backend gloo"):
        elastic_checks.check_elastic(config, 4)


def test_a_job_torchrun_restarted_resumes_from_its_run_folder(monkeypatch, tmp_path, capsys):
    """Outside a restart nothing changes; a restart needs --run-dir (said in one sentence);
    a folder with no checkpoint yet is started over (the resume itself: the slow test)."""
    from paratrain.run.agent_restart import resume_after_agent_restart

    given = config(run_dir=str(tmp_path / "run"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_after_agent_restart(given) == given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="pass --run-dir"):
        resume_after_agent_restart(config())
    (tmp_path / "run").mkdir()
    again = resume_after_agent_restart(given)
    assert again.overwrite and again.resume is None
    assert "holds no checkpoint yet, so the job starts over there." in capsys.readouterr().err


def test_a_member_dead_before_the_group_forms_moves_the_others_to_the_newer_generation():
    """Two workers die a moment apart: the launcher posts generation 1 (members 0, 1, 3)
    after the first death and generation 2 (0, 3) after the second. Worker 1 never
    arrives at generation 1, so the survivors waiting there move on to generation 2 as
    soon as it is posted, instead of forming a group that waits the whole timeout for a
    dead member; a generation everyone reached is formed as it is."""
    store = dist.HashStore()
    post_members(store, next_generation(store), [0, 1, 3])
    post_members(store, next_generation(store), [0, 3])
    first = Generation(1, (0, 1, 3), 2)
    assert gather(store, first, timeout_s=30.0) == 2  # worker 0: generation 2 is posted
    store.add("paratrain/elastic/2/arrived", 1)  # ... and it arrives there
    chosen = generation_to_join(store, 1, read_post(store, 1), 3, 2, 30.0)  # worker 3
    assert (chosen.number, chosen.members) == (2, (0, 3))
    with pytest.raises(RuntimeError, match="launch rank 1 was declared lost while alive"):
        generation_to_join(store, 2, read_post(store, 2), 1, 2, 30.0)
    whole = dist.HashStore()
    post_members(whole, next_generation(whole), [0, 1])
    whole.add("paratrain/elastic/1/arrived", 1)  # worker 1 arrived first
    assert gather(whole, Generation(1, (0, 1), 2), timeout_s=30.0) is None
