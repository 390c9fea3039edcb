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
seconds lost per fault, median and max (elastic: each death's ``workers`` record's
``seconds_lost``, from the start of the interrupted step to the new group's engine holding
the state; each join's, from the boundary, apart; restarts: the run's extra wall time over
the fault-free run, per fault, which also counts the relaunch), the
final train loss, and the final weights against the fault-free run (largest per-tensor
relative difference; the bar is ``test_elastic.TOLERANCE``'s derivation at this run's
steps and batch).

The default is the issue's shape: 400 steps, 5 kills at steps drawn from a seeded RNG
(the seed and the plan are printed), checkpoints every 50 steps. The run without
grow-back can lose at most ``devices - 1`` workers (``--min-devices`` 1), so with more
kills than that it is left out (said in the output) and the kills go to ranks other than
the holder, each at least three steps after the last, so the replacement of a killed rank
has joined (at the hold two steps on) before that rank can be killed again. ``--quick``
is the earlier 60-step shape: 3 kills, checkpoints every 10 steps, all four runs.
Seconds lost by a join are the survivors' stall at the boundary (the new group, the engine
rebuilt, the state sent), not the replacement's start-up, which the hold makes the
survivors wait out (it is in the wall time, not in seconds lost).

    PYTHONPATH=src:. python benchmarks/bench_elastic.py [--quick] [--steps 400] [--kills 5]
        [--seed 0] [--checkpoint-every 50]
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


HOLDER = 0  # the worker that holds for each replacement when kills outnumber the others


def kill_plan(steps: int, kills: int, seed: int) -> list[tuple[int, int]]:
    """(slot, step) of each kill, steps drawn without repeats, none in the first three
    steps or the last; a slot is one of the ``DEVICES`` places (``grow_fault`` names the
    launch rank holding it by then). Up to ``DEVICES - 1`` kills: distinct slots (the
    lead's may be one), any steps. More (only with grow-back): slots other than
    ``HOLDER``'s, steps at least three apart, so each replacement has joined (at the hold
    two steps after its kill) before the next kill, which may be its own."""
    rng = random.Random(seed)
    if kills < DEVICES:
        at = sorted(rng.sample(range(3, steps - 1), kills))
        slots = rng.sample(range(DEVICES), kills)
        return list(zip(slots, at, strict=True))
    room = steps - 4 - 2 * (kills - 1)  # step i gains 2 * i: gaps of at least 3
    if room < kills:
        raise SystemExit(f"{kills} kills three steps apart need more than {steps} steps.")
    at = [step + 2 * i for i, step in enumerate(sorted(rng.sample(range(3, 3 + room), kills)))]
    slots = [rng.choice([s for s in range(DEVICES) if s != HOLDER]) for _ in at]
    return list(zip(slots, at, strict=True))


def grow_fault(plan: list[tuple[int, int]], steps: int) -> str:
    """The kills, by launch rank, and a hold two steps after each by a worker never
    killed: it waits for the replacement to be ready, so each joins there (a replacement's
    start-up takes longer than many steps at this load, and a later kill may be its own),
    at the cost of the survivors waiting out its start-up. A replacement takes the next
    unused launch rank (``DEVICES``, then up), which then holds the dead worker's slot."""
    holder = min(set(range(DEVICES)) - {slot for slot, _ in plan})
    holding, faults = list(range(DEVICES)), []
    for slot, step in plan:
        faults.append(f"kill:{holding[slot]}:{step}:forward")
        holding[slot] = DEVICES + len(faults) - 1
    holds = [f"hold:{holder}:{step + 2}" for _, step in plan if step + 2 <= steps]
    return ",".join(faults + holds)


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


def spread(values: list[float]) -> tuple[str, str]:
    """Median and max, or dashes where there are none."""
    if not values:
        return ("-", "-")
    return (f"{statistics.median(values):.2f}", f"{max(values):.2f}")


def elastic_row(name: str, wall_s: float, run_dir: Path, reference: dict) -> tuple:
    """An elastic run's row from its ``workers`` records: the steps redone, and the
    seconds lost apart for deaths (the fault itself) and joins (the boundary a
    replacement costs the survivors), which are different costs."""
    got = read(run_dir)
    deaths = [c["seconds_lost"] for c in got["changes"] if c["lost_ranks"]]
    joins = [c["seconds_lost"] for c in got["changes"] if c["joined_ranks"]]
    final = load_model_state(run_dir / "final")
    redone = sum(c["steps_redone"] for c in got["changes"])
    error = relative_error(final, reference)
    return (name, wall_s, redone, *spread(deaths), *spread(joins), got["final_loss"], error)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps, 3 kills, ckpt/10")
    parser.add_argument("--steps", type=int, default=None, help="400 (--quick: 60)")
    parser.add_argument("--kills", type=int, default=None, help="5 (--quick: 3)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="50 (--quick: 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, full, quick in (("steps", 400, 60), ("kills", 5, 3), ("checkpoint_every", 50, 10)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main() -> None:
    args = parse()
    plan = kill_plan(args.steps, args.kills, args.seed)
    print(f"gpt, dp on {DEVICES} workers, {args.steps} steps, seed {args.seed}, ", end="")
    print(f"kills (slot = launch rank before any replacement, step): {plan}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    clean_s = run(root / "clean", args.steps, "")
    reference = load_model_state(root / "clean" / "final")
    rows = [("fault-free", clean_s, 0, "-", "-", "-", "-", read(root / "clean")["final_loss"], 0.0)]
    if args.kills < DEVICES:  # without replacements, one worker must remain
        elastic_fault = ",".join(f"kill:{rank}:{step}:forward" for rank, step in plan)
        elastic_s = run(root / "elastic", args.steps, elastic_fault, "--elastic")
        rows.append(elastic_row("elastic", elastic_s, root / "elastic", reference))
    else:
        print(f"elastic without grow-back left out: {args.kills} kills of {DEVICES} workers.")
    grow_flags = ("--elastic", "--max-restarts", str(args.kills))
    grow_s = run(root / "grow", args.steps, grow_fault(plan, args.steps), *grow_flags)
    rows.append(elastic_row("elastic, grow back", grow_s, root / "grow", reference))
    # The k-th kill fires in attempt k (each restart runs until the next kill).
    restart_fault = ",".join(f"kill:{r}:{s}:forward:{k}" for k, (r, s) in enumerate(plan))
    flags = ["--max-restarts", str(args.kills), "--checkpoint-every", str(args.checkpoint_every)]
    restart_s = run(root / "restart", args.steps, restart_fault, *flags)
    restart = read(root / "restart")
    rows.append(
        (
            f"restarts (ckpt/{args.checkpoint_every})",
            restart_s,
            restart["steps_redone"] + args.kills,
            f"{(restart_s - clean_s) / args.kills:.2f} (mean)",
            "-",
            "-",
            "-",
            restart["final_loss"],
            relative_error(load_model_state(root / "restart" / "final"), reference),
        )
    )
    report(rows, args.steps, root)


def report(rows: list[tuple], steps: int, root: Path) -> None:
    """The table: seconds lost per death (median, max) and per join, apart."""
    print(f"{'run':<22}{'wall s':>8}{'redone':>8}{'lost/death s':>14}{'max':>7}", end="")
    print(f"{'lost/join s':>13}{'max':>7}{'final loss':>12}{'weights vs clean':>18}")
    for name, wall, redone, death, most, join, join_most, loss, error in rows:
        print(f"{name:<22}{wall:>8.1f}{redone:>8}{death:>14}{most:>7}", end="")
        print(f"{join:>13}{join_most:>7}{loss:>12.5f}{error:>18.2e}")
    print(f"weights bar (steps x batch x 2^-24): {steps * GLOBAL_BATCH * 2.0**-24:.2e}")
    for name in ("elastic", "grow"):
        if (root / name).exists():
            for change in read(root / name)["changes"]:
                print(name, {k: v for k, v in change.items() if k not in ("kind", "time_s")})
    print(f"run folders under {root}")


if __name__ == "__main__":
    main()
