"""paratrain.launch works unchanged inside a job started by torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_launch_inside_torchrun_runs_the_worker_in_each_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "torchrun_job.py"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # Both ranks share one stdout, so their lines may interleave: pick out each object.
    reports = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", completed.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world"] == 2 for r in reports)
    assert reports[0]["checksum"] == reports[1]["checksum"]
    assert reports[0]["loss"] == reports[1]["loss"]
