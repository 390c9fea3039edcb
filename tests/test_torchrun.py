"""paratrain.launch and ``paratrain train`` work unchanged inside a job started by torchrun.

The README's API example is taken from README.md itself (the block marked
``readme-example: train.py``) and run as printed, so the documented script is the tested
one: locally, under ``torchrun --standalone``, and as two torchrun "nodes" on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.readme_examples import ROOT, example_env, readme_example

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SHORT_MLP_RUN = [
    "train", "--model", "mlp", "--dataset", "synthetic", "--steps", "3", "--global-batch", "8",
    "--no-progress",
]  # fmt: skip
"""The CLI's arguments for a three-step mlp run, after torchrun's and the entry point."""


def _run(command: list[str], cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=example_env(),
        check=False,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_example_output(completed: subprocess.CompletedProcess, folder: Path) -> None:
    assert completed.returncode == 0, completed.stderr[-3000:]
    # Only the main process saves and says so; both ranks train.
    assert completed.stdout.count("saved model.pt from 2 workers") == 1, completed.stdout
    state = torch.load(folder / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.slow
def test_launch_inside_torchrun_runs_the_worker_in_each_process():
    completed = _run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "torchrun_job.py"),
        ],
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # Both ranks share one stdout, so their lines may interleave: pick out each list.
    lists = [json.loads(found) for found in re.findall(r"\[.*?\]\]|\[[^\[\]]*\]", completed.stdout)]
    by_length = [entries for entries in lists if len(entries) == 2]
    full = [entries for entries in by_length if None not in entries]
    partial = [entries for entries in by_length if None in entries]
    # Rank 0 gets every rank's value; rank 1 its own, with None in rank 0's place.
    assert len(full) == 1 and len(partial) == 1, completed.stdout
    reports = full[0]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world"] == 2 for r in reports)
    assert reports[0]["checksum"] == reports[1]["checksum"]
    assert reports[0]["loss"] == reports[1]["loss"]
    assert partial[0] == [None, reports[1]]


@pytest.mark.slow
def test_readme_example_runs_as_printed_locally_and_under_torchrun(tmp_path):
    script = readme_example("train.py", tmp_path)
    local = tmp_path / "local"
    local.mkdir()
    completed = _run([sys.executable, str(script)], cwd=local)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "saved model.pt" in completed.stdout
    standalone = tmp_path / "standalone"
    standalone.mkdir()
    completed = _run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)], standalone)
    _check_example_output(completed, standalone)


@pytest.mark.slow
def test_readme_example_runs_as_two_torchrun_nodes_on_one_host(tmp_path):
    script = readme_example("train.py", tmp_path)
    port = str(_free_port())

    def node(rank: int) -> list[str]:
        return [
            *TORCHRUN,
            "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", port,
            str(script),
        ]  # fmt: skip

    second = subprocess.Popen(
        node(1), cwd=tmp_path, env=example_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        first = _run(node(0), tmp_path)
        out, err = second.communicate(timeout=180)
    finally:
        second.kill()
    assert second.returncode == 0, err.decode()[-3000:]
    # The second node's rank is not the main process: it trains but neither saves nor says so.
    assert "saved model.pt" not in out.decode()
    _check_example_output(first, tmp_path)


@pytest.mark.slow
def test_cli_under_torchrun_prints_one_summary_and_refuses_another_device_count(tmp_path):
    train = [
        *TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "paratrain",
        *SHORT_MLP_RUN, "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    completed = _run(train, tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("paratrain train: mlp on synthetic") == 1, completed.stdout
    assert "2 worker(s)" in completed.stdout
    refused = _run([*train, "--devices", "4"], tmp_path)
    assert refused.returncode != 0
    assert "devices=4 was asked for inside a torchrun job of 2 processes" in refused.stderr, (
        refused.stderr[-3000:]
    )
    # One sentence from paratrain, no traceback of ours (torchrun adds its own report after).
    assert "ConfigError" not in refused.stderr and "paratrain/cli/" not in refused.stderr


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_said_once_when_rank_0_is_the_last_to_refuse(tmp_path):
    """Rank 0 a second and a half late (tests/late_rank_zero_train.py): rank 1 refuses
    first and waits while rank 0 says the sentence and exits; torchrun then stops rank 1.
    Before, rank 1 exited at once, torchrun stopped rank 0 before it printed, and stderr
    held torchrun's failure report alone (the test above met that once in a full run)."""
    refused = _run(
        [
            *TORCHRUN, "--standalone", "--nproc-per-node", "2",
            str(ROOT / "tests" / "late_rank_zero_train.py"), *SHORT_MLP_RUN,
            "--run-dir", str(tmp_path / "run"), "--devices", "4",
        ],
        tmp_path,
    )  # fmt: skip
    assert refused.returncode != 0
    sentence = "devices=4 was asked for inside a torchrun job of 2 processes"
    assert refused.stderr.count(sentence) == 1, refused.stderr[-3000:]
    assert "paratrain: error: " in refused.stderr and "(rank 1)" not in refused.stderr


@pytest.mark.slow
def test_cli_under_torchrun_ranks_with_different_clocks_share_one_run_folder(tmp_path):
    """Without --run-dir, rank 1's clock an hour ahead (tests/skewed_clock_train.py): the
    default folder is named once, by rank 0, and both ranks write the one checkpoint
    there (before: rank 1 wrote into a folder of its own time, which rank 0 never made)."""
    completed = _run(
        [
            *TORCHRUN, "--standalone", "--nproc-per-node", "2",
            str(ROOT / "tests" / "skewed_clock_train.py"), *SHORT_MLP_RUN,
        ],
        tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders
    assert sorted(p.name for p in (folders[0] / "final").iterdir()) == [
        "manifest.json",
        "model-0.safetensors",
        "optim-0.safetensors",
        "rng-0.safetensors",
        "rng-1.safetensors",
    ]


@pytest.mark.slow
def test_cli_under_torchrun_refuses_a_run_folder_once(tmp_path):
    """A refusal made before training is the same on every rank; it is printed once
    (by rank 0), not once per rank, and no rank raises a traceback of ours."""
    (tmp_path / "taken").write_text("not a folder")
    refused = _run(
        [
            *TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "paratrain", "train",
            "--model", "mlp", "--dataset", "synthetic", "--steps", "3", "--no-progress",
            "--run-dir", str(tmp_path / "taken"),
        ],
        tmp_path,
    )  # fmt: skip
    assert refused.returncode != 0
    assert refused.stderr.count("is a file, not a folder") == 1, refused.stderr[-3000:]
    # torchrun adds its own report after; none of ours (before: a FileExistsError per rank).
    assert "FileExistsError" not in refused.stderr and "paratrain/run/" not in refused.stderr
