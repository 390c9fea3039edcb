"""A gpt run that loses workers: elastic dp against the fault-free run and against restarts.

Three runs of the same gpt on the same global batches, each a ``paratrain train`` process
timed from outside:

- fault-free: dp on 4 workers;
- elastic: ``--elastic``, with worker kills (SIGKILL) at steps drawn with a fixed seed; the
  survivors go on at 3, then 2, ... workers;
- elastic, grow back: the same kills with ``--elastic --max-restarts <kills>``: the
  launcher starts a replacement per death, which joins at a step boundary once it has
  loaded its data (``joined`` records), so the run ends at 4 workers again; a hold two
  steps after each kill (``grow_fault``) makes it join there, so its wall time includes
  the survivors waiting out each replacement's start-up;
- restarts: the same kills under ``--max-restarts`` with ``--checkpoint-every`` (the way
  through a death without ``--elastic``): each restart starts every worker again from the
  newest checkpoint (the k-th kill fires in the k-th attempt, so each kill happens once).

Measured: steps redone (steps computed more than once: elastic, each ``workers`` record's
``steps_redone``, the step in flight or none; restarts, the train records of a step already
logged, every step being logged, plus the step in flight at each kill, never logged),
seconds lost per fault (elastic: each ``workers`` record's ``seconds_lost``, from the start
of the interrupted step to the new group's engine holding the state; restarts: the run's
extra wall time over the fault-free run, per fault, which also counts the relaunch), the
final train loss, and the final weights against the fault-free run (largest per-tensor
relative difference; the bar is ``test_elastic.TOLERANCE``'s derivation at this run's
steps and batch).

The run without grow-back can lose at most ``devices - min_devices`` workers, so the
issue's 5 kills in a 400-step run become 3 kills in a 60-step run here (checkpoints every
10 steps, the issue's 50 scaled to the run's length); ``--steps``/``--kills`` change them.
Seconds lost by a join are the survivors' stall at the boundary (the new group, the engine
rebuilt, the state sent), not the replacement's start-up, which overlaps training.

    PYTHONPATH=src:. python benchmarks/bench_elastic.py [--steps 60] [--kills 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.checkpoints.format import load_model_state

DEVICES = 4
GLOBAL_BATCH = 24  # splits evenly over 1 to 4 workers
MODEL = [
    "--model",
    "gpt",
    "--dataset",
    "synthetic_tokens",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--block-size",
    "32",
]


def kill_plan(steps: int, kills: int, seed: int) -> list[tuple[int, int]]:
    """(launch rank, step) of each kill: distinct ranks (the lead may be one), steps drawn
    without repeats, none in the first three steps or the last."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(3, steps - 1), kills))
    ranks = rng.sample(range(DEVICES), kills)
    return list(zip(ranks, at, strict=True))


def grow_fault(plan: list[tuple[int, int]], steps: int) -> str:
    """The kills, and a hold two steps after each by a worker never killed: it waits for
    the replacement to be ready, so each joins there (a run this short would otherwise
    end before a replacement has started: at this load that takes longer than the steps
    left), at the cost of the survivors waiting out its start-up."""
    holder = min(set(range(DEVICES)) - {rank for rank, _ in plan})
    holds = [f"hold:{holder}:{step + 2}" for _, step in plan if step + 2 <= steps]
    return ",".join([f"kill:{rank}:{step}:forward" for rank, step in plan] + holds)


def run(run_dir: Path, steps: int, fault: str, *flags: str) -> float:
    """One ``paratrain train`` process; returns its wall time."""
    command = [sys.executable, "-m", "paratrain", "train", "--no-progress", *MODEL]
    command += ["--strategy", "dp", "--devices", str(DEVICES), "--steps", str(steps)]
    command += ["--global-batch", str(GLOBAL_BATCH), "--log-every", "1", "--eval-every", "0"]
    command += ["--sample-chars", "0", "--timeout", "120", "--run-dir", str(run_dir), *flags]
    env = {**os.environ, "PARATRAIN_FAULT": fault}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def read(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    final = [r for r in records if r["kind"] == "summary"][-1]
    return {
        "steps_redone": len(steps) - len(set(steps)),
        "changes": [r for r in records if r["kind"] == "workers"],
        "final_loss": final["final_train_loss"],
    }


def relative_error(state: dict, reference: dict) -> float:
    return max(
        (state[name] - ref).norm().item() / max(ref.norm().item(), 1e-12)
        for name, ref in reference.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.kills > DEVICES - 1:
        raise SystemExit(f"at most {DEVICES - 1} kills: no grow-back, one worker must remain.")
    plan = kill_plan(args.steps, args.kills, args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    clean_s = run(root / "clean", args.steps, "")
    elastic_fault = ",".join(f"kill:{rank}:{step}:forward" for rank, step in plan)
    elastic_s = run(root / "elastic", args.steps, elastic_fault, "--elastic")
    grow_flags = ("--elastic", "--max-restarts", str(args.kills))
    grow_s = run(root / "grow", args.steps, grow_fault(plan, args.steps), *grow_flags)
    # The k-th kill fires in attempt k (each restart runs until the next kill).
    restart_fault = ",".join(f"kill:{r}:{s}:forward:{k}" for k, (r, s) in enumerate(plan))
    flags = ["--max-restarts", str(args.kills), "--checkpoint-every", str(args.checkpoint_every)]
    restart_s = run(root / "restart", args.steps, restart_fault, *flags)
    reference = load_model_state(root / "clean" / "final")
    elastic, restart = read(root / "elastic"), read(root / "restart")
    grow = read(root / "grow")
    lost = [c["seconds_lost"] for c in elastic["changes"]]
    grow_lost = [c["seconds_lost"] for c in grow["changes"]]
    bar = args.steps * GLOBAL_BATCH * 2.0**-24
    rows = [
        ("fault-free", clean_s, 0, "-", "-", read(root / "clean")["final_loss"], 0.0),
        (
            "elastic",
            elastic_s,
            sum(c["steps_redone"] for c in elastic["changes"]),
            f"{statistics.median(lost):.2f}",
            f"{max(lost):.2f}",
            elastic["final_loss"],
            relative_error(load_model_state(root / "elastic" / "final"), reference),
        ),
        (
            "elastic, grow back",
            grow_s,
            sum(c["steps_redone"] for c in grow["changes"]),
            f"{statistics.median(grow_lost):.2f}",
            f"{max(grow_lost):.2f}",
            grow["final_loss"],
            relative_error(load_model_state(root / "grow" / "final"), reference),
        ),
        (
            f"restarts (ckpt/{args.checkpoint_every})",
            restart_s,
            restart["steps_redone"] + args.kills,
            f"{(restart_s - clean_s) / args.kills:.2f} (mean)",
            "-",
            restart["final_loss"],
            relative_error(load_model_state(root / "restart" / "final"), reference),
        ),
    ]
    print(f"gpt, dp on {DEVICES} workers, {args.steps} steps, kills (rank, step): {plan}")
    print(f"{'run':<22}{'wall s':>8}{'redone':>8}{'lost/fault s':>16}{'max':>7}", end="")
    print(f"{'final loss':>12}{'weights vs clean':>18}")
    for name, wall, redone, median, most, loss, error in rows:
        print(f"{name:<22}{wall:>8.1f}{redone:>8}{median:>16}{most:>7}{loss:>12.5f}", end="")
        print(f"{error:>18.2e}")
    print(f"weights bar (steps x batch x 2^-24): {bar:.2e}")
    for name, changes in (("elastic", elastic["changes"]), ("grow back", grow["changes"])):
        for change in changes:
            print(name, {k: v for k, v in change.items() if k not in ("kind", "time_s")})
    print(f"run folders under {root}")


if __name__ == "__main__":
    main()
