"""paratrain's pipeline engine against torch.distributed.pipelining, side by side in one run.

For each model (mlp, gpt), stage count (2, 4) and schedule (GPipe, 1F1B), one launch builds
the same stage split (paratrain's parameter-balanced partition) both ways in every worker:
paratrain's engine, and torch's ``PipelineStage`` driven by ``ScheduleGPipe`` or
``Schedule1F1B`` with the same micro-batches (m = 4p). The two alternate round by round on
the same global batches, so machine noise hits both alike. Reported: median step time
(max over ranks), samples/s, the throughput ratio paratrain/torch (target >= 1.1), and
paratrain's measured bubble next to the theory (p-1)/(m+p-1) (target: within 1.1x).

    python benchmarks/bench_pipeline.py            # full table
    python benchmarks/bench_pipeline.py --quick    # one short launch each
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from alternation import median_step_times, over_launches, slowest_rank
from torch import nn

import paratrain
from paratrain.models import build_model, loss_for
from paratrain.parallel.pipeline.timeline import measured_bubble, read_timeline, theoretical_bubble

# Layers of equal size, so that stages can be balanced at layer granularity and the bubble
# compares with the theory, which assumes equal stages.
MODELS = {
    "mlp": {
        "options": {"in_features": 1024, "hidden": 1024, "depth": 4, "classes": 10},
        "global_batch": 512,
    },
    "gpt": {
        "options": {"vocab_size": 65, "block_size": 64, "n_layer": 8, "n_head": 4, "n_embd": 128},
        "global_batch": 64,
    },
}
SCHEDULES = ("gpipe", "1f1b")


def make_batches(name: str, spec: dict, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batch = spec["global_batch"]
    out = []
    for _ in range(count):
        if name == "gpt":
            vocab, block = spec["options"]["vocab_size"], spec["options"]["block_size"]
            x = torch.randint(0, vocab, (batch, block), generator=generator)
            y = torch.randint(0, vocab, (batch, block), generator=generator)
        else:
            x = torch.randn(batch, spec["options"]["in_features"], generator=generator)
            y = torch.randint(0, spec["options"]["classes"], (batch,), generator=generator)
        out.append((x, y))
    return out


def fresh_model(name: str, spec: dict) -> nn.Sequential:
    torch.manual_seed(0)
    return build_model(name, **spec["options"])


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


class ParatrainRunner:
    def __init__(self, name: str, spec: dict, stages: int, micro: int, schedule: str) -> None:
        self.engine = paratrain.setup(
            fresh_model(name, spec),
            optimizer=sgd,
            loss_fn=loss_for(name),
            strategy="pipeline",
            stages=stages,
            micro_batches=micro,
            schedule=schedule,
        )

    def step(self, x, y) -> None:
        self.engine.train_step(x, y)


class TorchRunner:
    """torch.distributed.pipelining on the same split, micro-batches and loss."""

    def __init__(
        self, name: str, spec: dict, balance: list[int], micro: int, schedule: str
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        rank, stages = dist.get_rank(), len(balance)
        start = sum(balance[:rank])
        layers = fresh_model(name, spec)
        module = nn.Sequential(*[layers[i] for i in range(start, start + balance[rank])])
        self.module = module
        self.optimizer = sgd(module.parameters())
        self.first, self.last = rank == 0, rank == stages - 1
        stage = PipelineStage(module, rank, stages, torch.device("cpu"))
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, n_microbatches=micro, loss_fn=loss_for(name))

    def step(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        self.optimizer.step()


def bench_worker(
    name: str, spec: dict, schedule: str, rounds: int, steps: int, run_dir: str
) -> dict:
    stages = dist.get_world_size()
    micro = 4 * stages
    ours = ParatrainRunner(name, spec, stages, micro, schedule)
    runners = {
        "paratrain": ours,
        "torch": TorchRunner(name, spec, ours.engine.balance, micro, schedule),
    }
    batches = make_batches(name, spec, steps)
    for runner in runners.values():  # warm up, then time only what the timeline records
        for x, y in batches[:2]:
            runner.step(x, y)
    ours.engine.events.clear()
    medians = median_step_times(runners, batches, rounds=rounds, warmup=0)
    ours.engine.write_timeline(run_dir, last_steps=ours.engine.steps_taken)
    return {
        "median_s": medians,
        "balance": ours.engine.balance,
        "activation_peak": ours.engine.activation_peak_bytes(),
    }


def measure(name: str, stages: int, schedule: str, rounds: int, steps: int) -> dict:
    # The spec travels with the call: spawned workers re-import this module afresh.
    spec = MODELS[name]
    with tempfile.TemporaryDirectory() as run_dir:
        results = paratrain.launch(
            bench_worker, devices=stages, args=(name, spec, schedule, rounds, steps, run_dir)
        )
        bubble = measured_bubble(read_timeline(Path(run_dir) / "timeline.jsonl"))
    median = slowest_rank([r["median_s"] for r in results])
    return {
        "median": median,
        "bubble": bubble,
        "balance": results[0]["balance"],
        "activation_peak": [r["activation_peak"] for r in results],
    }


def run(models, stage_counts, schedules, rounds, steps, repeats) -> list[dict]:
    rows = []
    for name in models:
        for stages in stage_counts:
            for schedule in schedules:
                runs = [measure(name, stages, schedule, rounds, steps) for _ in range(repeats)]
                median, ratios = over_launches(
                    [r["median"] for r in runs], ours="paratrain", peer="torch"
                )
                micro, batch = 4 * stages, MODELS[name]["global_batch"]
                theory = theoretical_bubble(stages, micro)
                bubble = statistics.median(r["bubble"] for r in runs)
                row = {
                    "model": name,
                    "stages": stages,
                    "schedule": schedule,
                    "micro_batches": micro,
                    "global_batch": batch,
                    "balance": runs[0]["balance"],
                    "median_step_s": median,
                    "samples_per_s": {key: batch / value for key, value in median.items()},
                    "paratrain_over_torch": statistics.median(ratios),
                    "paratrain_over_torch_range": [min(ratios), max(ratios)],
                    "bubble_measured": bubble,
                    "bubble_theory": theory,
                    "bubble_ratio": bubble / theory,
                    "activation_peak_bytes": runs[0]["activation_peak"],
                }
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


HEADER = (
    "| model | stages x micro | schedule | torch ms | paratrain ms | paratrain samples/s "
    "| paratrain/torch (range) | bubble measured | bubble theory | measured/theory "
    "| activation peak per stage (MiB) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    ms = {key: f"{value * 1e3:.1f}" for key, value in row["median_step_s"].items()}
    low, high = row["paratrain_over_torch_range"]
    return (
        f"| {row['model']} | {row['stages']} x {row['micro_batches']} | {row['schedule']} "
        f"| {ms['torch']} | {ms['paratrain']} | {row['samples_per_s']['paratrain']:.0f} "
        f"| {row['paratrain_over_torch']:.2f} ({low:.2f}-{high:.2f}) "
        f"| {row['bubble_measured']:.1%} | {row['bubble_theory']:.1%} "
        f"| {row['bubble_ratio']:.2f} "
        f"| {', '.join(f'{b / 2**20:.1f}' for b in row['activation_peak_bytes'])} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="launches per configuration")
    parser.add_argument("--quick", action="store_true", help="1 launch of 2 rounds x 2 steps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rounds, steps, repeats = (2, 2, 1) if args.quick else (args.rounds, args.steps, args.repeats)
    print(f"torch {torch.__version__}, {repeats} launch(es) x {rounds} rounds x {steps} steps")
    print(HEADER, flush=True)
    rows = run(args.models, args.stages, args.schedules, rounds, steps, repeats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
