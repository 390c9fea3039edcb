"""Mixed precision, recompute and the memory ledger against PyTorch DDP, side by side.

For each setting (fp32, bf16, fp16, fp32 + recompute) one launch builds the model twice
in every worker, PyTorch DDP written the usual way (``torch.autocast``, ``GradScaler``,
``torch.utils.checkpoint`` per layer) and paratrain dp with the same option, and
alternates them round by round on the same batches. Reported: median step times, the
DDP/paratrain time ratio (>= 1.0: paratrain at least as fast), and the ledger's
activation and total peaks. A third runner, paratrain measuring memory on *every* step,
gives the ledger's cost: its extra time per measured step, and that cost spread over
``METER_EVERY`` steps, as it is in a run.

    python benchmarks/bench_memory.py            # gpt, 2 workers, all settings
    python benchmarks/bench_memory.py --quick    # one short launch each, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from alternation import median_step_times, over_launches, slowest_rank
from bench_dp import MODELS, DDPRunner, adam, fresh_model, make_batches
from torch.utils.checkpoint import checkpoint

import paratrain
from paratrain.models import loss_for
from paratrain.parallel.memory_tracking import METER_EVERY

SETTINGS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "recompute": {"recompute": True},
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PeerRunner(DDPRunner):
    """DDP with autocast, a GradScaler for fp16, and a checkpoint per layer for recompute."""

    def __init__(self, name: str, setting: dict) -> None:
        super().__init__(name)
        dtype = _DTYPES.get(setting.get("precision", "fp32"))
        self.autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else nullcontext
        fp16 = setting.get("precision") == "fp16"
        self.scaler = torch.amp.GradScaler("cpu") if fp16 else None
        self.recompute = setting.get("recompute", False)

    def forward(self, x):
        if not self.recompute:
            return self.model(x)
        for layer in self.model.module:
            x = checkpoint(layer, x, use_reentrant=False)
        return x

    def step(self, x, y) -> None:
        share = x.shape[0] // self.world
        xs, ys = (t.narrow(0, self.rank * share, share) for t in (x, y))
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss_fn(self.forward(xs), ys)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()


class OursRunner:
    def __init__(self, name: str, setting: dict, meter_every: int = METER_EVERY) -> None:
        self.engine = paratrain.setup(
            fresh_model(name), optimizer=adam, loss_fn=loss_for(name), strategy="dp", **setting
        )
        self.engine.memory.meter_every = meter_every

    def step(self, x, y) -> None:
        self.engine.train_step(x, y)


def bench_worker(name: str, setting: dict, rounds: int, steps: int, warmup: int) -> dict:
    ours = OursRunner(name, setting)
    runners = {
        "ddp": PeerRunner(name, setting),
        "paratrain": ours,
        "metered": OursRunner(name, setting, meter_every=1),
    }
    medians = median_step_times(runners, make_batches(name, steps), rounds=rounds, warmup=warmup)
    return {"median_s": medians, "ledger": ours.engine.memory.ledger.record()}


def run(name: str, workers: int, settings: list[str], rounds: int, steps: int, repeats: int):
    rows = []
    for key in settings:
        launches = [
            paratrain.launch(
                bench_worker, devices=workers, args=(name, SETTINGS[key], rounds, steps, 2)
            )
            for _ in range(repeats)
        ]
        timings = [slowest_rank([r["median_s"] for r in launch]) for launch in launches]
        median, over_ddp = over_launches(timings, ours="paratrain", peer="ddp")
        ledger = launches[0][0]["ledger"]
        extra = median["metered"] - median["paratrain"]
        row = {
            "model": name,
            "workers": workers,
            "setting": key,
            "median_step_s": median,
            "ddp_over_paratrain": statistics.median(over_ddp),
            "ddp_over_paratrain_range": [min(over_ddp), max(over_ddp)],
            "activation_peak_bytes": ledger["peak"]["activations"],
            "ledger_peak_bytes": ledger["peak_total"],
            "metering_extra_s": extra,
            "metering_share": extra / METER_EVERY / median["paratrain"],
        }
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = (
    "| model | workers | setting | DDP ms | paratrain ms | DDP/paratrain (range) "
    "| activations peak | ledger peak | metered step +ms | ledger cost per step |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    ms = {key: value * 1e3 for key, value in row["median_step_s"].items()}
    low, high = row["ddp_over_paratrain_range"]
    return (
        f"| {row['model']} | {row['workers']} | {row['setting']} | {ms['ddp']:.1f} "
        f"| {ms['paratrain']:.1f} | {row['ddp_over_paratrain']:.3f} ({low:.3f}-{high:.3f}) "
        f"| {row['activation_peak_bytes'] / 2**20:.2f} MiB "
        f"| {row['ledger_peak_bytes'] / 2**20:.2f} MiB "
        f"| {row['metering_extra_s'] * 1e3:+.2f} | {row['metering_share']:.3%} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=list(MODELS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="launches per setting")
    parser.add_argument("--quick", action="store_true", help="1 launch of 2 rounds x 3 steps")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rounds, steps, repeats = (2, 3, 1) if args.quick else (args.rounds, args.steps, args.repeats)
    print(
        f"torch {torch.__version__}, {repeats} launch(es) x {rounds} rounds x {steps} steps; "
        f"medians over steps, then launches; the ledger measures every {METER_EVERY} steps"
    )
    print(HEADER, flush=True)
    rows = run(args.model, args.workers, args.settings, rounds, steps, repeats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
