"""The largest ``gpt`` each strategy trains with Adam on N workers under a memory budget.

Every worker behaves like a device of ``--memory-per-device`` bytes (the engines' memory
ledger raises ``DeviceOutOfMemory`` when its total goes over), so the search rehearses on
CPU what would fit on real devices of that size. For each strategy the script searches
the model width: it doubles ``n_embd`` until a probe runs out of memory, then bisects
between the last width that trained and the first that did not. A probe is a real launch
of N workers that builds the model, wraps it with ``paratrain.setup(strategy=...)`` and
trains ``--steps`` Adam steps (the first step allocates the optimizer state, so at least
two are run); a probe that fails for any reason other than the budget stops the script.
Probes that cannot fit are refused before any worker starts, as ``paratrain train``
refuses them: when the ZeRO formula for the model state alone exceeds the budget, or
when building the whole model on every worker would not fit in this machine's memory
(``refuse_before_launch``).

Depth, context and batch stay fixed, so parameters grow with width squared and each
strategy's answer is one ``n_embd``. Reported per strategy: the largest width, its
parameter count, the ratio to dp's, and the probe's per-worker peak ledger total.

    python benchmarks/largest_gpt.py                               # 4 workers, 1 GiB each
    python benchmarks/largest_gpt.py --memory-per-device 2GiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import paratrain
from paratrain.models import build_model, loss_for
from paratrain.models.gpt import gpt_parameter_count
from paratrain.parallel.fit_advice import model_state_per_worker
from paratrain.runtime.launch import WorkerError
from paratrain.runtime.units import parse_size

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "pipeline")
WIDTH_STEP = 64
"""Widths are multiples of this (one attention head per 64 channels)."""
HOST_RAM_SHARE = 0.6
"""At most this share of the machine's available memory may go to building the models."""
PRECISION = 0.05
"""Bisection stops when the last failing width is within this fraction of the best."""
OUT_OF_MEMORY = "DeviceOutOfMemory"


def model_config(width: int, args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab_size": 65,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": width // WIDTH_STEP,
        "n_embd": width,
    }


def probe_worker(strategy: str, config: dict, budget: str, steps: int, batch: int, stages: int):
    """Runs in each worker: train ``steps`` Adam steps; returns this worker's ledger."""
    torch.manual_seed(0)
    model = build_model("gpt", **config)
    options = {"stages": stages} if strategy == "pipeline" else {}
    engine = paratrain.setup(
        model,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        memory_per_device=budget,
        **options,
    )
    generator = torch.Generator().manual_seed(1)
    shape = (batch, config["block_size"])
    for _ in range(steps):
        inputs = torch.randint(0, config["vocab_size"], shape, generator=generator)
        targets = torch.randint(0, config["vocab_size"], shape, generator=generator)
        loss = engine.train_step(inputs, targets).loss
    return {"loss": loss, "ledger": engine.memory.ledger.record()}


def refuse_before_launch(strategy: str, config: dict, args: argparse.Namespace) -> str | None:
    """Why a probe cannot fit, decided without starting workers, or None.

    Two checks, both sound (they never refuse a model that would train): the ZeRO formula
    for the model state a worker holds (``fit_advice.model_state_per_worker``; every
    engine holds at least that, padding and activations come on top) against the budget,
    and this machine's real memory: every worker builds the whole model before ``setup``
    shards or splits it, so ``workers`` full fp32 copies must fit in the RAM available.
    """
    parameters = gpt_parameter_count(**config)
    budget = parse_size(args.memory_per_device)
    least = model_state_per_worker(strategy, parameters, args.workers)
    if least > budget:
        return f"its model state alone needs {least / 2**20:,.0f} MiB per worker"
    building = args.workers * 4 * parameters
    available = host_available_bytes()
    if building > HOST_RAM_SHARE * available:
        return (
            f"building it on {args.workers} workers needs {building / 2**30:.1f} GiB of this "
            f"machine's {available / 2**30:.1f} GiB available"
        )
    return None


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe(strategy: str, width: int, args: argparse.Namespace) -> dict | None:
    """The workers' ledgers if ``width`` trains, None if a worker ran out of its budget."""
    config = model_config(width, args)
    refusal = refuse_before_launch(strategy, config, args)
    if refusal:
        print(f"  {strategy:<9} n_embd {width:>5}: refused before launch, {refusal}", flush=True)
        return None
    started = time.perf_counter()
    try:
        ledgers = paratrain.launch(
            probe_worker,
            devices=args.workers,
            args=(strategy, config, args.memory_per_device, args.steps, args.batch, args.workers),
        )
    except WorkerError as error:
        if OUT_OF_MEMORY not in error.details:
            raise
        reason = error.details.strip().splitlines()[-1]
        print(f"  {strategy:<9} n_embd {width:>5}: out of memory ({reason[:160]})", flush=True)
        return None
    peak = max(r["ledger"]["peak_total"] for r in ledgers)
    print(
        f"  {strategy:<9} n_embd {width:>5}: trained, peak {peak / 2**20:,.0f} MiB per worker "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return {"width": width, "peak_total": peak, "loss": ledgers[0]["loss"]}


def largest_width(strategy: str, args: argparse.Namespace, start: int) -> dict | None:
    """Double from ``start`` until a probe fails, then bisect on multiples of WIDTH_STEP
    until the gap is within ``PRECISION`` of the best width."""
    best, width = None, start
    while True:
        result = probe(strategy, width, args)
        if result is None:
            break
        best, width = result, width * 2
    low = best["width"] if best else 0
    high = width
    while high - low > max(WIDTH_STEP, PRECISION * low):
        middle = (low + high) // 2 // WIDTH_STEP * WIDTH_STEP
        result = probe(strategy, middle, args)
        if result is None:
            high = middle
        else:
            best, low = result, middle
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--memory-per-device", default="1GiB")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--start-width", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}.")
    if args.start_width % WIDTH_STEP or args.start_width < WIDTH_STEP:
        parser.error(f"--start-width must be a positive multiple of {WIDTH_STEP}.")
    if args.steps < 2:
        parser.error("--steps must be at least 2: Adam allocates its state in the first step.")
    print(
        f"largest gpt with Adam: {args.workers} workers x {args.memory_per_device}, "
        f"{args.n_layer} blocks, context {args.block_size}, global batch {args.batch}",
        flush=True,
    )
    found: dict[str, dict | None] = {}
    for strategy in strategies:
        # Sharding never holds more than dp, so the others start from dp's answer.
        start = found["dp"]["width"] if found.get("dp") else args.start_width
        found[strategy] = largest_width(strategy, args, start)
    rows = []
    dp_params = None
    if found.get("dp"):
        dp_params = gpt_parameter_count(**model_config(found["dp"]["width"], args))
    print("\n| strategy | largest n_embd | parameters | x dp | peak per worker |")
    print("|---|---|---|---|---|")
    for strategy, best in found.items():
        if best is None:
            print(f"| {strategy} | none fits | - | - | - |")
            rows.append({"strategy": strategy, "width": None})
            continue
        params = gpt_parameter_count(**model_config(best["width"], args))
        ratio = params / dp_params if dp_params else None
        shown = f"{ratio:.2f}" if ratio else "-"
        print(
            f"| {strategy} | {best['width']} | {params / 1e6:,.1f} M | {shown} | "
            f"{best['peak_total'] / 2**20:,.0f} MiB |"
        )
        rows.append({"strategy": strategy, "parameters": params, "ratio_to_dp": ratio, **best})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
