"""How right the planner is: its predictions against real runs, on this machine.

Memory: for each configuration (every strategy, 2 and 4 workers, fp32 and bf16, recompute
on and off, on ``mlp``, ``gpt``, a model of the user's own blocks and Hugging Face GPT-2
and Llama), the planner's ``predicted_peak_bytes`` (``paratrain.predict``) against the
peak of live tensor storages on the highest worker (``planner_memory.py``), an
independent count: not the engines' ledger.

Choice: for each scenario (a model that fits each worker, one that fits only sharded, one
that fits only split, under ``memory_per_device``), every candidate the planner predicts
to fit is run for a few steps; reported are the chosen plan's measured step time against
the fastest measured candidate's, whether any candidate predicted to fit ran out of
memory, the Spearman rank correlation of predicted and measured step times, and the
chosen plan's predicted step time over its measured one. Where a scenario's workers
outnumber the cores (4 workers on this 2-core machine) they time-share them: the table
says so ("contended") beside the figures, and the load average of the machine (other
processes on it) at the start and end of each scenario.

    python benchmarks/bench_planner.py                 # both parts
    python benchmarks/bench_planner.py --part memory   # or choice
    python benchmarks/bench_planner.py --part choice --scenario 1   # one scenario
    python benchmarks/bench_planner.py --json out.json

Step times are medians over the timed steps of one launch, and their fastest: the
planner predicts from the fastest of its own runs (the machine's cost, not the moment's
load), and on a CPU other processes share the median swings between launches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.models import build_model, loss_for
from paratrain.planner.choose import NoPlanFits
from paratrain.planner.machine import cores
from paratrain.runtime.launch import WorkerError
from paratrain.runtime.units import format_bytes

MODELS = {
    "mlp": {
        "kind": "mlp",
        "options": {"in_features": 256, "hidden": 512, "depth": 3, "classes": 10},
    },
    "gpt": {
        "kind": "gpt",
        "options": {"vocab_size": 65, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 128},
    },
    "blocks": {"kind": "blocks", "options": {"width": 128, "hidden": 512, "depth": 4}},
    "gpt2": {
        "kind": "gpt2",
        "options": {"vocab_size": 256, "n_positions": 32, "n_embd": 128, "n_layer": 2, "n_head": 4},
    },
}
"""``blocks``: no reference model, the user's own residual blocks as an nn.Sequential;
``gpt2``: Hugging Face's ``GPT2LMHeadModel`` from a tiny config (no download, no dropout),
a model that is no layer list, fed a dict batch and trained on its own next-token loss."""


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(name: str, overrides: dict | None = None) -> nn.Module:
    spec = MODELS[name]
    options = {**spec["options"], **(overrides or {})}
    torch.manual_seed(0)
    if spec["kind"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        config = GPT2Config(**options, **dropout, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    if spec["kind"] == "blocks":
        width = options["width"]
        return nn.Sequential(
            nn.Linear(64, width),
            *(Block(width, options["hidden"]) for _ in range(options["depth"])),
            nn.Linear(width, 10),
        )
    return build_model(spec["kind"], **options)


def loss(name: str):
    if MODELS[name]["kind"] == "gpt2":
        from paratrain.losses import causal_lm_cross_entropy

        return causal_lm_cross_entropy
    return loss_for("gpt" if MODELS[name]["kind"] == "gpt" else "mlp")


def batch(name: str, size: int, overrides: dict | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    options = {**MODELS[name]["options"], **(overrides or {})}
    if MODELS[name]["kind"] == "gpt2":
        shape = (size, options["n_positions"])
        ids = torch.randint(0, options["vocab_size"], shape, generator=generator)
        return {"input_ids": ids}, ids.clone()
    if MODELS[name]["kind"] == "gpt":
        shape = (size, options["block_size"])
        return (
            torch.randint(0, options["vocab_size"], shape, generator=generator),
            torch.randint(0, options["vocab_size"], shape, generator=generator),
        )
    features = 64 if MODELS[name]["kind"] == "blocks" else options["in_features"]
    return (
        torch.randn(size, features, generator=generator),
        torch.randint(0, 10, (size,), generator=generator),
    )


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def run_worker(name, overrides, strategy, setup_options, global_batch, steps, budget):
    """Train ``steps`` steps; this worker's peak ledger total and median step seconds."""
    options = dict(setup_options)
    engine = paratrain.setup(
        build(name, overrides),
        optimizer=adam,
        loss_fn=loss(name),
        strategy=strategy,
        memory_per_device=budget,
        **options,
    )
    seconds = []
    for step in range(steps):
        x, y = batch(name, global_batch, overrides, seed=step)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        engine.train_step(x, y)
        seconds.append(time.perf_counter() - start)
    report = engine.memory_report()
    timed = seconds[1:]
    return {
        "peak": report["total"]["peak"],
        "step_s": statistics.median(timed),
        "fastest_s": min(timed),
    }


def measure(name, overrides, strategy, options, devices, global_batch, steps, budget=None):
    """The run's highest worker peak and its step time (the slowest worker's), or None
    where a worker ran out of its budget."""
    args = (name, overrides, strategy, options, global_batch, steps, budget)
    try:
        if strategy == "single":
            results = [run_worker(*args)]
        else:
            results = paratrain.launch(run_worker, devices=devices, args=args)
    except WorkerError as error:
        if "DeviceOutOfMemory" in error.details:
            return None
        raise
    return {
        "peak": max(r["peak"] for r in results),
        "step_s": max(r["step_s"] for r in results),
        "fastest_s": max(r["fastest_s"] for r in results),
    }


def memory_part(global_batch: int, steps: int) -> list[dict]:
    """Predicted peaks against the live count (``planner_memory``)."""
    import planner_memory

    return planner_memory.memory_part(global_batch, steps)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for position, index in enumerate(order):
            out[index] = float(position)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return 1.0
    d = sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True))
    return 1 - 6 * d / (n * (n * n - 1))


SCENARIOS = [
    # (label, model, model overrides, devices, global batch, budget)
    ("fits each worker", "mlp", {"hidden": 1024}, 2, 64, "128MiB"),
    ("fits only sharded", "gpt", {"n_embd": 256, "n_layer": 4}, 4, 16, "26MiB"),
    ("fits only split", "blocks", {"width": 512, "hidden": 2048, "depth": 2}, 4, 16, "40MiB"),
    ("Hugging Face GPT-2", "gpt2", {}, 2, 16, "256MiB"),
]


def contention(devices: int) -> str:
    """Where the workers outnumber this machine's cores they time-share them: say so
    beside the figures rather than fit the model to them."""
    available = cores()
    if devices > available:
        return f"contended: {devices} workers on {available} cores"
    return f"{devices} workers on {available} cores"


def load() -> str:
    """The machine's load average over the last minute (other processes share the cores)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def choice_part(steps: int, only: list[int] | None = None) -> list[dict]:
    rows = []
    for index, (label, name, overrides, devices, global_batch, budget) in enumerate(SCENARIOS):
        if only and index + 1 not in only:
            continue
        print(
            f"\n## {label}: {name} {overrides}, {devices} workers x {budget} "
            f"({contention(devices)}; load {load()} at the start)",
            flush=True,
        )
        row = choose_and_run(label, name, overrides, devices, global_batch, budget, steps)
        if row is not None:
            row["machine"] = f"{contention(devices)}; load {row['load_start']} to {load()}"
            rows.append(row)
    print(
        "\n| scenario | machine | candidates run | Spearman (median; fastest step) | chosen | "
        "chosen / fastest measured | chosen predicted / measured (median; fastest step) | "
        "out of memory |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['scenario']} | {row['machine']} | {row['candidates_run']} | "
            f"{row['spearman']:.2f}; {row['spearman_fastest']:.2f} | "
            f"{row['chosen']} {row['chosen_described']} | {row['chosen_over_fastest']:.2f}x | "
            f"{row['chosen_predicted_over_measured']:.2f}; "
            f"{row['chosen_predicted_over_fastest_step']:.2f} | {row['out_of_memory']} |"
        )
    return rows


def choose_and_run(label, name, overrides, devices, global_batch, budget, steps) -> dict | None:
    """The plan for one scenario, every candidate predicted to fit run for ``steps``
    steps, and the figures: Spearman of predicted against measured step times,
    the chosen plan's measured step over the fastest measured, and its prediction over
    its measurement."""
    started = load()
    try:
        plan = paratrain.plan(
            build(name, overrides),
            devices=devices,
            global_batch=global_batch,
            memory_per_device=budget,
            optimizer=adam,
            loss_fn=loss(name),
            sample=batch(name, global_batch, overrides),
            gradient_accumulation=1,
        )
    except NoPlanFits as error:
        print(f"no plan fits: {error}")
        return None
    print(plan.summary())
    fitting = [c for c in plan.candidates if c.verdict == "chosen" or c.verdict.startswith("fits")]
    results = []
    for candidate in fitting:
        measured = measure(
            name,
            overrides,
            candidate.strategy,
            candidate.setup_options,
            devices,
            global_batch,
            steps,
            budget,
        )
        results.append((candidate, measured))
        predicted = candidate.prediction.step_s
        status = (
            "OUT OF MEMORY"
            if measured is None
            else (
                f"{measured['step_s']:.4f} s, fastest {measured['fastest_s']:.4f} s "
                f"(predicted / measured {predicted / measured['step_s']:.2f}; "
                f"{predicted / measured['fastest_s']:.2f}), peak {format_bytes(measured['peak'])}"
            )
        )
        print(
            f"  {candidate.strategy:<9} {candidate.mesh(devices):<6} "
            f"{candidate.describe_options():<40} predicted {predicted:.4f} s "
            f"{format_bytes(candidate.peak):>10}; measured {status}",
            flush=True,
        )
    ran = [(c, m) for c, m in results if m is not None]
    oom = [c for c, m in results if m is None]
    chosen_candidate, chosen = next((c, m) for c, m in results if c.verdict == "chosen")
    fastest = min(m["step_s"] for _, m in ran)
    rho = spearman([c.prediction.step_s for c, _ in ran], [m["step_s"] for _, m in ran])
    rho_fastest = spearman([c.prediction.step_s for c, _ in ran], [m["fastest_s"] for _, m in ran])
    row = {
        "scenario": label,
        "load_start": started,
        "candidates_run": len(results),
        "out_of_memory": len(oom),
        "chosen": plan.strategy,
        "chosen_described": f"{chosen_candidate.mesh(devices)} "
        f"{chosen_candidate.describe_options()}",
        "chosen_options": plan.options,
        "chosen_over_fastest": chosen["step_s"] / fastest if chosen else float("nan"),
        "chosen_predicted_over_measured": (
            plan.predicted_step_s / chosen["step_s"] if chosen else float("nan")
        ),
        "spearman": rho,
        "spearman_fastest": rho_fastest,
        "chosen_predicted_over_fastest_step": (
            plan.predicted_step_s / chosen["fastest_s"] if chosen else float("nan")
        ),
    }
    print(
        f"chosen {plan.strategy}: {row['chosen_over_fastest']:.2f}x the fastest measured, "
        f"predicted / measured {row['chosen_predicted_over_measured']:.2f}; "
        f"{len(oom)} of {len(results)} predicted to fit ran out of memory; Spearman {rho:.2f}"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "choice", "both"), default="both")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first untimed)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--scenario",
        type=int,
        action="append",
        default=None,
        help="run only this choice scenario (1-based; repeat for several)",
    )
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}; {args.steps} steps per run")
    out = {}
    if args.part in ("memory", "both"):
        out["memory"] = memory_part(args.global_batch, args.steps)
    if args.part in ("choice", "both"):
        out["choice"] = choice_part(args.steps, args.scenario)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
