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
layout's answer is one ``n_embd``. Reported per layout: the largest width, its parameter
count, the ratio to dp's, and the probe's per-worker peak ledger total. Layouts are
strategies with their options: ``pipeline`` (one stage per worker), ``tp`` (every layer
split over every worker), ``pipeline+tp`` (2 stages x workers/2 tensor) and ``zero2+tp``
(2 tensor, the replicas sharding); ``tp+vocab`` is tp with the token embedding and the
head split by vocabulary too, the loss computed on the split logits (``--vocab-size``
large, as GPT-2's 50304, shows what that adds). Widths under a tensor degree t are
multiples of 64 t, so that t divides the heads.

    python benchmarks/largest_gpt.py                               # 4 workers, 1 GiB each
    python benchmarks/largest_gpt.py --memory-per-device 2GiB --json out.json
    python benchmarks/largest_gpt.py --workers 2 --strategies tp,tp+vocab --vocab-size 50304
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
from paratrain.models.gpt import gpt_parameter_count, gpt_tp_plan
from paratrain.parallel.fit_advice import model_state_per_worker
from paratrain.runtime.launch import WorkerError
from paratrain.runtime.units import parse_size

LAYOUTS = {
    "dp": ("dp", lambda workers: {}),
    "zero1": ("zero1", lambda workers: {}),
    "zero2": ("zero2", lambda workers: {}),
    "zero3": ("zero3", lambda workers: {}),
    "pipeline": ("pipeline", lambda workers: {"stages": workers}),
    "tp": ("tp", lambda workers: {"tensor": workers}),
    "pipeline+tp": ("pipeline", lambda workers: {"stages": 2, "tensor": workers // 2}),
    "zero2+tp": ("zero2", lambda workers: {"tensor": 2}),
    "tp+vocab": ("tp", lambda workers: {"tensor": workers, "vocab": True}),
}
"""Name -> (strategy, its options for ``workers`` workers)."""
WIDTH_STEP = 64
"""Widths are multiples of this (one attention head per 64 channels), times the tensor
degree."""
HOST_RAM_SHARE = 0.6
"""At most this share of the machine's available memory may go to building the models."""
PRECISION = 0.05
"""Bisection stops when the last failing width is within this fraction of the best."""
OUT_OF_MEMORY = "DeviceOutOfMemory"


def model_config(width: int, args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab_size": args.vocab_size,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": width // WIDTH_STEP,
        "n_embd": width,
    }


def layout_of(name: str, workers: int) -> tuple[str, dict]:
    strategy, options = LAYOUTS[name]
    return strategy, options(workers)


def engine_options(options: dict, config: dict) -> dict:
    """The layout's options as ``setup`` takes them: ``vocab`` becomes gpt's plan with the
    embedding and head split by vocabulary."""
    options = dict(options)
    if options.pop("vocab", False):
        options["tp_plan"] = gpt_tp_plan(n_layer=config["n_layer"])
    return options


def width_step(name: str, workers: int) -> int:
    return WIDTH_STEP * layout_of(name, workers)[1].get("tensor", 1)


def probe_worker(strategy: str, options: dict, config: dict, budget: str, steps: int, batch: int):
    """Runs in each worker: train ``steps`` Adam steps; returns this worker's ledger."""
    torch.manual_seed(0)
    model = build_model("gpt", **config)
    engine = paratrain.setup(
        model,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        memory_per_device=budget,
        **engine_options(options, config),
    )
    generator = torch.Generator().manual_seed(1)
    shape = (batch, config["block_size"])
    for _ in range(steps):
        inputs = torch.randint(0, config["vocab_size"], shape, generator=generator)
        targets = torch.randint(0, config["vocab_size"], shape, generator=generator)
        loss = engine.train_step(inputs, targets).loss
    return {"loss": loss, "ledger": engine.memory.ledger.record()}


def refuse_before_launch(name: str, config: dict, args: argparse.Namespace) -> str | None:
    """Why a probe cannot fit, decided without starting workers, or None.

    Two checks, both sound (they never refuse a model that would train): the ZeRO formula
    for the model state a worker holds (``fit_advice.model_state_per_worker``; every
    engine holds at least that, padding and activations come on top) against the budget,
    and this machine's real memory: every worker builds the whole model before ``setup``
    shards or splits it, so ``workers`` full fp32 copies must fit in the RAM available.
    """
    parameters = gpt_parameter_count(**config)
    budget = parse_size(args.memory_per_device)
    strategy, options = layout_of(name, args.workers)
    options = {k: v for k, v in options.items() if k != "vocab"}
    least = model_state_per_worker(strategy, parameters, args.workers, **options)
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


def probe(name: str, width: int, args: argparse.Namespace) -> dict | None:
    """The workers' ledgers if ``width`` trains, None if a worker ran out of its budget."""
    config = model_config(width, args)
    refusal = refuse_before_launch(name, config, args)
    if refusal:
        print(f"  {name:<11} n_embd {width:>5}: refused before launch, {refusal}", flush=True)
        return None
    started = time.perf_counter()
    strategy, options = layout_of(name, args.workers)
    try:
        ledgers = paratrain.launch(
            probe_worker,
            devices=args.workers,
            args=(strategy, options, config, args.memory_per_device, args.steps, args.batch),
        )
    except WorkerError as error:
        if OUT_OF_MEMORY not in error.details:
            raise
        reason = error.details.strip().splitlines()[-1]
        print(f"  {name:<11} n_embd {width:>5}: out of memory ({reason[:160]})", flush=True)
        return None
    peak = max(r["ledger"]["peak_total"] for r in ledgers)
    print(
        f"  {name:<11} n_embd {width:>5}: trained, peak {peak / 2**20:,.0f} MiB per worker "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return {"width": width, "peak_total": peak, "loss": ledgers[0]["loss"]}


def largest_width(name: str, args: argparse.Namespace, start: int) -> dict | None:
    """Double from ``start`` until a probe fails, then bisect on multiples of the layout's
    width step until the gap is within ``PRECISION`` of the best width."""
    step = width_step(name, args.workers)
    best, width = None, max(step, start // step * step)
    while True:
        result = probe(name, width, args)
        if result is None:
            break
        best, width = result, width * 2
    low = best["width"] if best else 0
    high = width
    while high - low > max(step, PRECISION * low):
        middle = (low + high) // 2 // step * step
        if middle <= low:
            break
        result = probe(name, middle, args)
        if result is None:
            high = middle
        else:
            best, low = result, middle
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--memory-per-device", default="1GiB")
    parser.add_argument(
        "--strategies", default=",".join(LAYOUTS), help=f"layouts among {', '.join(LAYOUTS)}"
    )
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument(
        "--vocab-size", type=int, default=65, help="tp+vocab needs one the workers divide"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--start-width", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}.")
    if args.start_width % WIDTH_STEP or args.start_width < WIDTH_STEP:
        parser.error(f"--start-width must be a positive multiple of {WIDTH_STEP}.")
    if args.steps < 2:
        parser.error("--steps must be at least 2: Adam allocates its state in the first step.")
    print(
        f"largest gpt with Adam: {args.workers} workers x {args.memory_per_device}, "
        f"{args.n_layer} blocks, context {args.block_size}, global batch {args.batch}, "
        f"vocabulary {args.vocab_size}",
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
    print("\n| layout | largest n_embd | parameters | x dp | peak per worker |")
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
