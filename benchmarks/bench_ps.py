"""paratrain ps (asynchronous, staleness 2, backup worker) against dp with a straggler.

Four workers train ``gpt`` on tinyshakespeare, one of them (rank 1) three times slower
than the others (it sleeps twice its measured step time after each step, so before its
next compute; under ps the engine's ``straggler`` option sleeps twice its last compute
between its pull and its compute). Each method trains from
the same initial weights on the same global batches: dp until ``--samples`` samples have
been applied, ps until ``--ps-samples`` (default twice as many: the question is how soon
each reaches the target loss, and a ps run cut at dp's sample count might stop just short
of it). The ps servers divide each push's learning rate by its staleness + 1
(``--staleness-lr``, the engine's default; ``constant`` shows what it buys), and
asynchronous pulls look ahead (the engine's default; ``ps-async-no-lookahead``, not run
unless named, shows what that buys). ``ps-backup1``
is synchronous ps with one backup worker: a version closes on the first three fresh
pushes, and the straggler's late pushes fold into the next one (see the engine's
``backup`` module). The methods run in the same worker processes, one after the other, in
an order that rotates from launch to launch, so that machine noise hits all of them alike.

Reported per method, medians over launches: samples/s (samples applied / wall time until
the last worker stopped), wall time until the training loss, averaged over the most recent
``--window`` global batches' worth of samples, first reaches the target loss (by default
the loss dp reaches at 80% of its run, in the same launch), the ratios to dp, and the loss
at dp's sample count (how much each method learns per sample), and the share of the
machine's CPU left idle during worker 0's run (Linux only). The targets: ps at least
1.8x dp's samples/s, and at most 0.7x dp's time to the target loss.

    python benchmarks/bench_ps.py                  # defaults: 4 workers, 3 launches
    python benchmarks/bench_ps.py --repeats 1 --samples 640   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain
from paratrain.data import build_dataset
from paratrain.models import build_model, loss_for
from paratrain.parallel.ps.stale_lr import POLICIES

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
METHODS = {
    "dp": {"strategy": "dp"},
    "ps-async": {"strategy": "ps", "staleness": None},
    "ps-staleness2": {"strategy": "ps", "staleness": 2},
    "ps-backup1": {"strategy": "ps", "staleness": 0, "backup_workers": 1},
    "ps-async-no-lookahead": {"strategy": "ps", "staleness": None, "lookahead": False},
}
DEFAULT_METHODS = ["dp", "ps-async", "ps-staleness2", "ps-backup1"]
TARGETS = {"samples_per_s": 1.8, "time_to_target": 0.7}


def global_batches(data_dir: str, block: int, batch: int, count: int):
    """The same ``count`` global batches of tinyshakespeare windows in every process."""
    bundle = build_dataset("shakespeare", data_dir=data_dir, block_size=block)
    order = torch.randperm(len(bundle.train), generator=torch.Generator().manual_seed(0))
    picks = [order[i * batch : (i + 1) * batch] for i in range(count)]
    return bundle.vocab_size, [bundle.train[p] for p in picks]


def train_one(method: str, settings: dict, batches: list, straggler: dict) -> dict:
    """Train one method until its budget of samples is applied; this worker's records."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model("gpt", **settings["model"])
    options = dict(METHODS[method])
    strategy = options.pop("strategy")
    budget = settings["samples"] if strategy == "dp" else settings["ps_samples"]
    if strategy == "ps":
        options["straggler"] = straggler
        options["staleness_lr"] = settings["staleness_lr"]
    engine = paratrain.setup(
        model,
        optimizer=lambda params: torch.optim.Adam(params, lr=settings["lr"]),
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        **options,
    )
    dist.barrier()  # the clock starts once every worker (and every server) is ready
    start = time.time()
    cpu_before = cpu_ticks()
    records, step = [], 0
    while True:
        if strategy == "dp" and step * len(batches[0][0]) >= budget:
            break
        if strategy == "ps" and engine.server_samples >= budget:
            break
        x, y = batches[step % len(batches)]
        began = time.perf_counter()
        stats = engine.train_step(x, y)
        if strategy == "dp" and rank == straggler["rank"]:
            time.sleep((straggler["slowdown"] - 1.0) * (time.perf_counter() - began))
        records.append((time.time() - start, stats.loss, stats.samples))
        step += 1
    end = time.time() - start
    result = {"records": records, "end": end, "steps": step, "cpu_idle": idle_share(cpu_before)}
    if strategy == "ps":
        engine.finish()
        dist.barrier()  # benchmark only: every worker stopped before the metrics are read
        result["metrics"] = engine.ps_metrics() if rank == 0 else None
        engine.close()
    else:
        result["samples"] = step * len(batches[0][0])
    dist.barrier()
    return result


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time counters (Linux ``/proc/stat``), or None elsewhere."""
    try:
        with open("/proc/stat") as handle:
            return [int(field) for field in handle.readline().split()[1:]]
    except OSError:
        return None


def idle_share(before: list[int] | None) -> float | None:
    """The share of the machine's CPU time that was idle since ``before``."""
    after = cpu_ticks()
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after, strict=False)]
    return (spent[3] + spent[4]) / max(1, sum(spent))  # idle and iowait


def bench_worker(order: list[str], settings: dict, straggler: dict) -> dict:
    vocab, batches = global_batches(
        settings["data_dir"], settings["block"], settings["batch"], settings["batches"]
    )
    settings = {**settings, "model": {**settings["model"], "vocab_size": vocab}}
    return {m: train_one(m, settings, batches, straggler) for m in order}


def time_to_target(records: list[tuple[float, float, int]], target: float, window: int):
    """First time the loss averaged over the last ``window`` samples is at most ``target``."""
    recent: deque[tuple[float, int]] = deque()
    held = 0
    for when, loss, samples in sorted(records):
        recent.append((loss, samples))
        held += samples
        while held - recent[0][1] >= window:
            held -= recent.popleft()[1]
        if held >= window and sum(loss * n for loss, n in recent) / held <= target:
            return when
    return None


def windowed_loss_at(records, at_samples: float | None, window: int) -> float:
    """The window-averaged loss once ``at_samples`` samples were trained (None: the end)."""
    ordered = sorted(records)
    seen, recent = 0, deque()
    for _, loss, samples in ordered:
        seen += samples
        recent.append((loss, samples))
        while sum(n for _, n in recent) - recent[0][1] >= window:
            recent.popleft()
        if at_samples is not None and seen >= at_samples:
            break
    return sum(loss * n for loss, n in recent) / sum(n for _, n in recent)


def analyse(launch: list[dict], target: float | None, window: int, methods: list[str]) -> dict:
    """Per method: samples/s, time to the target loss, and what ps measured."""
    dp_records, dp_samples = launch[0]["dp"]["records"], launch[0]["dp"]["samples"]
    if target is None:
        target = windowed_loss_at(dp_records, 0.8 * dp_samples, window)
    out = {"target_loss": target}
    for method in methods:
        per_worker = [r[method] for r in launch]
        wall = max(r["end"] for r in per_worker)
        if method == "dp":
            records, samples = dp_records, per_worker[0]["samples"]
        else:
            records = [rec for r in per_worker for rec in r["records"]]
            samples = per_worker[0]["metrics"]["samples_applied"]
        metrics = per_worker[0].get("metrics") or {}
        out[method] = {
            "samples_per_s": samples / wall,
            "time_to_target": time_to_target(records, target, window),
            "final_loss": windowed_loss_at(records, None, window),
            "loss_at_dp_samples": windowed_loss_at(records, dp_samples, window),
            # Read by worker 0 over its own run (the fast workers stop first under ps).
            "cpu_idle": per_worker[0]["cpu_idle"],
            "mean_lr_factor": metrics.get("mean_lr_factor"),
            "pushes_per_s": metrics.get("pushes_per_s"),
            "staleness_histogram": metrics.get("staleness_histogram"),
        }
    return out


def run(args: argparse.Namespace) -> dict:
    """``repeats`` launches, the method order rotating; medians and ratios over launches."""
    ps_samples = args.ps_samples or 2 * args.samples
    settings = {
        "data_dir": str(args.data_dir),
        "block": args.block_size,
        "batch": args.global_batch,
        # Enough that no worker ever trains on a batch twice: a ps worker pushes at most
        # every push of its run, each of a 1/workers share of a global batch.
        "batches": max(
            args.samples // args.global_batch, ps_samples * args.workers // args.global_batch, 1
        ),
        "samples": args.samples,
        "ps_samples": ps_samples,
        "staleness_lr": args.staleness_lr,
        "lr": args.lr,
        "model": {
            "block_size": args.block_size,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "n_embd": args.n_embd,
        },
    }
    straggler = {"rank": args.straggler_rank, "slowdown": args.slowdown}
    window = args.window * args.global_batch
    launches = []
    names = ["dp", *(m for m in args.methods if m != "dp")]
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        results = paratrain.launch(
            bench_worker, devices=args.workers, args=(order, settings, straggler)
        )
        launches.append(analyse(results, args.target_loss, window, names))
        print(f"launch {repeat + 1}/{args.repeats} (order {', '.join(order)}) done", flush=True)
    return summarize(launches, names)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(launches: list[dict], methods: list[str]) -> dict:
    rows = {}
    for method in methods:
        runs = [launch[method] for launch in launches]
        dp = [launch["dp"] for launch in launches]
        rows[method] = {
            "samples_per_s": _median([r["samples_per_s"] for r in runs]),
            "time_to_target": _median([r["time_to_target"] for r in runs]),
            "final_loss": _median([r["final_loss"] for r in runs]),
            "loss_at_dp_samples": _median([r["loss_at_dp_samples"] for r in runs]),
            "cpu_idle": _median([r["cpu_idle"] for r in runs]),
            "mean_lr_factor": _median([r["mean_lr_factor"] for r in runs]),
            "samples_per_s_over_dp": _median(
                [r["samples_per_s"] / d["samples_per_s"] for r, d in zip(runs, dp, strict=True)]
            ),
            "time_to_target_over_dp": _median(
                [
                    r["time_to_target"] / d["time_to_target"]
                    if r["time_to_target"] and d["time_to_target"]
                    else None
                    for r, d in zip(runs, dp, strict=True)
                ]
            ),
            "reached_target": sum(r["time_to_target"] is not None for r in runs),
            "pushes_per_s": runs[-1]["pushes_per_s"],
            "staleness_histogram": runs[-1]["staleness_histogram"],
        }
    return {
        "methods": methods,
        "launches": len(launches),
        "target_loss": [run["target_loss"] for run in launches],
        **rows,
    }


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def format_table(summary: dict) -> str:
    lines = [
        "| method | samples/s | vs dp | time to target (s) | vs dp | reached | loss at dp's "
        "samples | final loss | lr factor | CPU idle | pushes/s per worker | push staleness |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method in summary["methods"]:
        row = summary[method]
        rates = row["pushes_per_s"]
        rates = ", ".join(f"{w}: {r:.1f}" for w, r in sorted(rates.items())) if rates else "-"
        histogram = row["staleness_histogram"]
        histogram = (
            ", ".join(f"{s}: {n}" for s, n in sorted(histogram.items())) if histogram else "-"
        )
        lines.append(
            f"| {method} | {_fmt(row['samples_per_s'], '.1f')} "
            f"| {_fmt(row['samples_per_s_over_dp'], '.2f', 'x')} "
            f"| {_fmt(row['time_to_target'], '.1f')} "
            f"| {_fmt(row['time_to_target_over_dp'], '.2f', 'x')} "
            f"| {row['reached_target']}/{summary['launches']} "
            f"| {_fmt(row['loss_at_dp_samples'], '.3f')} | {_fmt(row['final_loss'], '.3f')} "
            f"| {_fmt(row['mean_lr_factor'], '.2f')} | {_fmt(row['cpu_idle'], '.0%')} "
            f"| {rates} | {histogram} |"
        )
    for method in summary["methods"][1:]:
        row = summary[method]
        speed, when = row["samples_per_s_over_dp"], row["time_to_target_over_dp"]
        lines.append(
            f"{method}: samples/s {_fmt(speed, '.2f', 'x')} dp (target >= "
            f"{TARGETS['samples_per_s']}x: {'met' if speed and speed >= 1.8 else 'NOT met'}), "
            f"time to target {_fmt(when, '.2f', 'x')} dp (target <= {TARGETS['time_to_target']}x: "
            f"{'met' if when is not None and when <= 0.7 else 'NOT met'})"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--straggler-rank", type=int, default=1)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--samples", type=int, default=32 * 80, help="samples dp trains")
    parser.add_argument(
        "--ps-samples", type=int, default=None, help="samples each ps run trains (default 2x)"
    )
    parser.add_argument("--staleness-lr", choices=POLICIES, default="inverse")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        default=DEFAULT_METHODS,
        help="dp always runs",
    )
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--window", type=int, default=4, help="global batches the loss averages")
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="launches")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.data_dir / "tinyshakespeare").exists():
        print(f"bench_ps: no tinyshakespeare under {args.data_dir}; pass --data-dir.")
        return 2
    print(
        f"torch {torch.__version__}; gpt on tinyshakespeare, {args.workers} workers, worker "
        f"{args.straggler_rank} {args.slowdown:g}x slower, {args.samples} samples for dp and "
        f"{args.ps_samples or 2 * args.samples} per ps run, staleness_lr {args.staleness_lr}, "
        f"{args.repeats} launch(es); medians over launches"
    )
    summary = run(args)
    print(format_table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
