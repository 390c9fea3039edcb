"""paratrain dp against plain PyTorch and PyTorch DDP, side by side in one run.

For each model (mlp, gpt) and worker count (1, 2, 4), one launch builds the same model
three ways in every worker (plain PyTorch at 1 worker only, DDP, paratrain dp) and
alternates them round by round on the same global batches, so that machine noise hits
all of them alike. Reported: median step time, samples/s, paratrain/DDP throughput ratio
(>= 1.0 means paratrain is at least as fast), paratrain/plain at 1 worker, and the bytes
paratrain hands to all-reduce per step per worker next to the ring optimum
2(N-1)/N x gradient bytes (the ring traffic of the payload is shown beside it).

    python benchmarks/bench_dp.py                 # full table
    python benchmarks/bench_dp.py --quick         # one short launch each, for a smoke run
    python benchmarks/bench_dp.py --json out.json # also write the figures
    python benchmarks/bench_dp.py --kernel fused  # every side on the fused Adam kernel

Optimizer kernel: by default every side gets ``Adam(params, lr=1e-4)`` as a user writes it;
plain PyTorch and DDP then run torch's CPU default (the per-tensor loop) and paratrain takes
the fused kernel (``paratrain.parallel.fused_optim``). ``--kernel fused`` asks every side for
``fused=True``, which compares the engines alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from alternation import median_step_times, over_launches, slowest_rank
from torch.nn.parallel import DistributedDataParallel

import paratrain
from paratrain.models import build_model, loss_for

MODELS = {
    "mlp": {
        "options": {"in_features": 784, "hidden": 1024, "depth": 3, "classes": 10},
        "global_batch": 256,
    },
    "gpt": {
        "options": {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
        "global_batch": 32,
    },
}


def make_batches(name: str, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(0)
    batch = spec["global_batch"]
    if name == "gpt":
        vocab, block = spec["options"]["vocab_size"], spec["options"]["block_size"]
        make = lambda: (  # noqa: E731
            torch.randint(0, vocab, (batch, block), generator=generator),
            torch.randint(0, vocab, (batch, block), generator=generator),
        )
    else:
        make = lambda: (  # noqa: E731
            torch.randn(batch, 784, generator=generator),
            torch.randint(0, 10, (batch,), generator=generator),
        )
    return [make() for _ in range(count)]


def fresh_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, **MODELS[name]["options"])


KERNELS = {"default": None, "fused": True}
_kernel = {"fused": None}  # set in each worker by bench_worker


def adam(params):
    return torch.optim.Adam(params, lr=1e-4, fused=_kernel["fused"])


class PlainRunner:
    """The loop a user writes for one process: the 1-worker baseline."""

    def __init__(self, name: str) -> None:
        self.model = fresh_model(name)
        self.optimizer = adam(self.model.parameters())
        self.loss_fn = loss_for(name)

    def step(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()


class DDPRunner:
    """PyTorch DDP with its defaults, fed this rank's share (as a DistributedSampler would)."""

    def __init__(self, name: str) -> None:
        self.model = DistributedDataParallel(fresh_model(name))
        self.optimizer = adam(self.model.parameters())
        self.loss_fn = loss_for(name)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def step(self, x, y) -> None:
        share = x.shape[0] // self.world
        xs, ys = (t.narrow(0, self.rank * share, share) for t in (x, y))
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(xs), ys)
        loss.backward()
        self.optimizer.step()


class ParatrainRunner:
    def __init__(self, name: str, options: dict) -> None:
        self.engine = paratrain.setup(
            fresh_model(name), optimizer=adam, loss_fn=loss_for(name), strategy="dp", **options
        )

        self.comm_bytes = 0

    def step(self, x, y) -> None:
        self.comm_bytes = self.engine.train_step(x, y).comm_bytes


def bench_worker(
    name: str, rounds: int, steps: int, warmup: int, options: dict, kernel: str = "default"
) -> dict:
    """Alternate the runners round by round; every rank times every step."""
    _kernel["fused"] = KERNELS[kernel]
    ours = ParatrainRunner(name, options)
    runners = {"ddp": DDPRunner(name), "paratrain": ours}
    if dist.get_world_size() == 1:
        runners["plain"] = PlainRunner(name)
    medians = median_step_times(runners, make_batches(name, steps), rounds=rounds, warmup=warmup)
    reducer = ours.engine.reducer
    grad_bytes = sum(p.numel() * p.element_size() for p in ours.engine.model.parameters())
    return {
        "median_s": medians,
        "comm_bytes": ours.comm_bytes,
        "grad_bytes": reducer.gradient_bytes if reducer is not None else grad_bytes,
    }


def measure(
    name: str, workers: int, rounds: int, steps: int, options: dict, kernel: str = "default"
) -> dict:
    """One launch: per-runner median step time (max over ranks: a step ends with the slowest)."""
    results = paratrain.launch(
        bench_worker, devices=workers, args=(name, rounds, steps, 3, options, kernel)
    )
    return {
        "median": slowest_rank([r["median_s"] for r in results]),
        "comm_bytes": results[0]["comm_bytes"],
        "grad_bytes": results[0]["grad_bytes"],
    }


def run(
    models: list[str],
    worker_counts: list[int],
    rounds: int,
    steps: int,
    options: dict,
    repeats: int,
    kernel: str = "default",
) -> list[dict]:
    """Each configuration is launched ``repeats`` times; figures are medians over launches."""
    rows = []
    for name in models:
        for workers in worker_counts:
            runs = [measure(name, workers, rounds, steps, options, kernel) for _ in range(repeats)]
            median, over_ddp = over_launches(
                [r["median"] for r in runs], ours="paratrain", peer="ddp"
            )
            over_plain = []
            if "plain" in median:
                _, over_plain = over_launches(
                    [r["median"] for r in runs], ours="paratrain", peer="plain"
                )
            batch = MODELS[name]["global_batch"]
            ring = 2 * (workers - 1) / workers
            row = {
                "model": name,
                "workers": workers,
                "global_batch": batch,
                "repeats": repeats,
                "median_step_s": median,
                "samples_per_s": {key: batch / value for key, value in median.items()},
                "paratrain_over_ddp": statistics.median(over_ddp),
                "paratrain_over_ddp_range": [min(over_ddp), max(over_ddp)],
                "paratrain_over_plain": statistics.median(over_plain) if over_plain else None,
                "allreduce_payload_bytes": runs[0]["comm_bytes"],
                "ring_traffic_bytes": ring * runs[0]["comm_bytes"],
                "ring_optimum_bytes": ring * runs[0]["grad_bytes"],
            }
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = (
    "| model | workers | plain ms | DDP ms | paratrain ms | paratrain samples/s "
    "| paratrain/DDP (range) | paratrain/plain | all-reduce bytes/step/worker (ring traffic) "
    "| ring optimum |\n|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    ms = {key: f"{value * 1e3:.1f}" for key, value in row["median_step_s"].items()}
    plain = row["paratrain_over_plain"]
    low, high = row["paratrain_over_ddp_range"]
    return (
        f"| {row['model']} | {row['workers']} | {ms.get('plain', '-')} | {ms['ddp']} "
        f"| {ms['paratrain']} | {row['samples_per_s']['paratrain']:.0f} "
        f"| {row['paratrain_over_ddp']:.3f} ({low:.3f}-{high:.3f}) "
        f"| {'-' if plain is None else f'{plain:.3f}'} "
        f"| {row['allreduce_payload_bytes']:,} ({row['ring_traffic_bytes']:,.0f}) "
        f"| {row['ring_optimum_bytes']:,.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="launches per configuration")
    parser.add_argument("--quick", action="store_true", help="1 launch of 2 rounds x 4 steps")
    parser.add_argument("--bucket-mb", type=float, default=None, help="paratrain dp option")
    parser.add_argument("--first-bucket-mb", type=float, default=None, help="paratrain dp option")
    parser.add_argument(
        "--kernel",
        choices=list(KERNELS),
        default="default",
        help="default: Adam as a user writes it; fused: every side asks for fused=True",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rounds, steps, repeats = (2, 4, 1) if args.quick else (args.rounds, args.steps, args.repeats)
    print(
        f"torch {torch.__version__}, {repeats} launch(es) x {rounds} rounds x {steps} steps; "
        f"Adam kernel: {args.kernel}; step times are medians over steps, then over launches"
    )
    print(HEADER, flush=True)
    options = {
        key: value
        for key, value in (("bucket_mb", args.bucket_mb), ("first_bucket_mb", args.first_bucket_mb))
        if value is not None
    }
    rows = run(args.models, args.workers, rounds, steps, options, repeats, args.kernel)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
