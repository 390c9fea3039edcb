"""What starting every step together costs on this machine: the ps benchmark's other control.

``bench_ps.py`` shows synchronous ps with a backup worker (three fast workers released
together at every version) running fewer samples/s than asynchronous ps (the same workers
running free), although it sends the same messages. This script separates the machine from
the engine: ``--processes`` plain processes (no paratrain engine, no messages) compute the
same forward and backward (the quick-start gpt on an 8-sample share, one thread each),
first free-running, then released together by a barrier before every step, and report
each one's CPU time per step. On a machine with fewer cores than processes the difference
is what lockstep itself costs (more context switches and colder caches per step), which
no engine can remove.

    python benchmarks/lockstep.py                  # 3 processes, 40 steps
    python benchmarks/lockstep.py --processes 4 --steps 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from paratrain.models import build_model, loss_for

MODEL = {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
SHARE = 8  # samples: a 32-sample global batch over 4 workers
MODES = ("free-running", "lockstep")


def compute(barrier, lockstep: bool, steps: int, results, index: int) -> None:
    """CPU milliseconds per forward and backward, barrier waits excluded."""
    torch.set_num_threads(1)
    torch.manual_seed(index)
    model = build_model("gpt", **MODEL)
    loss_fn = loss_for("gpt")
    inputs = torch.randint(0, MODEL["vocab_size"], (SHARE, MODEL["block_size"]))
    targets = torch.randint(0, MODEL["vocab_size"], (SHARE, MODEL["block_size"]))
    for _ in range(3):  # warm-up
        loss_fn(model(inputs), targets).backward()
    spent = 0.0
    for _ in range(steps):
        if lockstep:
            barrier.wait()
        began = time.process_time()
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        spent += time.process_time() - began
    results[index] = spent / steps * 1e3


def measure(processes: int, steps: int, lockstep: bool) -> list[float]:
    context = mp.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Array("d", processes)
    workers = [
        context.Process(target=compute, args=(barrier, lockstep, steps, results, i))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
        if worker.exitcode != 0:
            raise RuntimeError(f"a measuring process failed (exit code {worker.exitcode}).")
    return list(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    if args.processes < 1 or args.steps < 1:
        parser.error("--processes and --steps must be at least 1.")
    print(f"torch {torch.__version__}; {args.processes} processes, {args.steps} steps each")
    rows = {mode: measure(args.processes, args.steps, mode == "lockstep") for mode in MODES}
    free = statistics.median(rows["free-running"])
    for mode, values in rows.items():
        median = statistics.median(values)
        print(
            f"{mode:>12}: CPU ms per step {', '.join(f'{v:.1f}' for v in values)} "
            f"(median {median:.1f}, {median / free:.2f}x free-running)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
