"""paratrain ZeRO against PyTorch's own: zero1 vs ZeroRedundancyOptimizer, zero3 vs FSDP2.

Pairs (the peer is what a PyTorch user would reach for):

- ``zero1`` against ``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping Adam,
  with the model in ``DistributedDataParallel`` (the usual pairing; both with defaults).
- ``zero3`` against FSDP2, ``torch.distributed.fsdp.fully_shard`` applied to every layer
  of the layer list and then to the model (its documented pattern, defaults otherwise).
  If FSDP2 does not run here (CPU workers on gloo), the output says so with the error and
  reports paratrain alone.

Both on ``gpt`` (paratrain.models) with fp32 Adam, at each worker count.

Time: one launch builds paratrain and its peer in the same worker processes and
alternates them round by round on the same global batches (``alternation.py``); a step
ends when the slowest rank ends, so the figure is the max over ranks of each rank's
median, then the median over ``--repeats`` launches. Throughput ratio = peer step time /
paratrain step time (>= 1.0: paratrain at least as fast).

Memory: a peak cannot be shared by two systems in one process, so each system gets its
own launches (alternating which goes first). Measured per worker as growth of the
process's resident memory over a baseline taken before the model is built:

- before the baseline, each worker runs one plain step of a throwaway copy of the model
  and frees it, so torch's lazily created runtime memory is not charged to either side;
- workers start with ``MALLOC_MMAP_THRESHOLD_=65536``, so every allocation of 64 KiB or
  more is its own mapping and goes back to the OS when freed; resident memory then
  follows the live tensor bytes (PyTorch has no CPU allocator statistics to ask);
- after building and ``--warmup`` steps (so optimizer state exists), the kernel's peak
  counter is reset (``/proc/self/clear_refs`` <- 5), so the one-off cost of building and
  sharding the full model is left out, and the timed steps run;
- reported: ``VmHWM - baseline`` (peak over the steps) and ``VmRSS - baseline`` between
  steps (what the worker holds), max over ranks, median over launches.

Both systems go through exactly the same procedure. Linux only (it reads /proc).

    python benchmarks/bench_zero.py                       # 2 and 4 workers, 3 launches
    python benchmarks/bench_zero.py --workers 2 --repeats 1 --rounds 2 --steps 3  # smoke
    python benchmarks/bench_zero.py --json out.json       # also write the figures
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from alternation import median_step_times, over_launches, slowest_rank

import paratrain
from paratrain.models import build_model, loss_for

GPT = {
    "options": {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
    "global_batch": 32,
}
PEERS = {"zero1": "ZeroRedundancyOptimizer+DDP", "zero3": "FSDP2 fully_shard"}
MMAP_THRESHOLD = "65536"


def make_batches(spec: dict, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    vocab, block = spec["options"]["vocab_size"], spec["options"]["block_size"]
    shape = (spec["global_batch"], block)
    return [
        (
            torch.randint(0, vocab, shape, generator=generator),
            torch.randint(0, vocab, shape, generator=generator),
        )
        for _ in range(count)
    ]


def fresh_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", **spec["options"])


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


class _Share:
    """This rank's contiguous share of the global batch (as a DistributedSampler gives)."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.shape[0] // self.world
        return tensor.narrow(0, self.rank * size, size)


class ParatrainRunner:
    def __init__(self, strategy: str, spec: dict) -> None:
        self.engine = paratrain.setup(
            fresh_model(spec), optimizer=adam, loss_fn=loss_for("gpt"), strategy=strategy
        )

    def step(self, x, y) -> None:
        self.engine.train_step(x, y)


class ZeroRedundancyRunner:
    """DDP for the gradients, ZeroRedundancyOptimizer for the sharded Adam step."""

    def __init__(self, spec: dict) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(fresh_model(spec))
        self.optimizer = ZeroRedundancyOptimizer(
            self.model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4
        )
        self.loss_fn, self.share = loss_for("gpt"), _Share()

    def step(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.model(self.share(x)), self.share(y)).backward()
        self.optimizer.step()


class FSDP2Runner:
    """fully_shard on every layer that has parameters, then on the model."""

    def __init__(self, spec: dict) -> None:
        from torch.distributed.fsdp import fully_shard

        self.model = fresh_model(spec)
        for layer in self.model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = adam(self.model.parameters())
        self.loss_fn, self.share = loss_for("gpt"), _Share()

    def step(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.model(self.share(x)), self.share(y)).backward()
        self.optimizer.step()


def build_runner(system: str, spec: dict):
    if system == "ZeroRedundancyOptimizer+DDP":
        return ZeroRedundancyRunner(spec)
    if system == "FSDP2 fully_shard":
        return FSDP2Runner(spec)
    return ParatrainRunner(system, spec)


def try_peer(strategy: str, spec: dict):
    """(runner, None), or (None, the error) when the peer cannot run here.

    Every rank must agree, so the outcome is all-reduced: one failing rank fails all.
    """
    runner, error = None, None
    try:
        runner = build_runner(PEERS[strategy], spec)
        x, y = make_batches(spec, 1)[0]
        runner.step(x, y)
    except Exception as failure:  # noqa: BLE001 - reported verbatim in the output
        runner = None
        error = "".join(traceback.format_exception_only(failure)).strip()
    failed = torch.tensor([0.0 if error is None else 1.0])
    dist.all_reduce(failed)
    if failed.item() and error is None:
        runner, error = None, "failed on another rank"
    return runner, error


def time_worker(strategy: str, spec: dict, rounds: int, steps: int, warmup: int) -> dict:
    """Alternate paratrain and its peer; every rank times every step."""
    runners = {"paratrain": ParatrainRunner(strategy, spec)}
    peer, error = try_peer(strategy, spec)
    if peer is not None:
        runners["peer"] = peer
    medians = median_step_times(runners, make_batches(spec, steps), rounds=rounds, warmup=warmup)
    return {"median_s": medians, "peer_error": error}


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"^{key}:\s+(\d+) kB", handle.read(), re.M).group(1)) * 1024


def _warm_runtime(spec: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One plain step of a throwaway model, then freed: torch's lazily created runtime
    memory (kernel workspaces, thread pools) lands before the baseline, not in either side.
    """
    model, share = fresh_model(spec), _Share()
    optimizer = adam(model.parameters())
    loss_for("gpt")(model(share(batch[0])), share(batch[1])).backward()
    optimizer.step()
    del model, optimizer
    gc.collect()


def memory_worker(system: str, spec: dict, steps: int, warmup: int) -> dict:
    """Resident-memory growth over the pre-model baseline: held between steps, and peak."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError("memory workers must start with MALLOC_MMAP_THRESHOLD_ set.")
    batches = make_batches(spec, steps)
    _warm_runtime(spec, batches[0])
    dist.barrier()
    baseline = _proc_status("VmRSS")
    runner = build_runner(system, spec)
    for x, y in batches[:warmup]:
        runner.step(x, y)
    held = _proc_status("VmRSS") - baseline
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak (VmHWM) to the current resident size
    for x, y in batches:
        runner.step(x, y)
    return {"peak": _proc_status("VmHWM") - baseline, "held": held}


@contextmanager
def _malloc_returns_memory():
    """Spawned workers inherit the environment: big allocations become unmappable."""
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


def measure_memory(system: str, spec: dict, workers: int, steps: int, warmup: int) -> dict:
    with _malloc_returns_memory():
        results = paratrain.launch(
            memory_worker, devices=workers, args=(system, spec, steps, warmup)
        )
    return {key: max(r[key] for r in results) for key in ("peak", "held")}


def run(
    strategies: list[str],
    worker_counts: list[int],
    *,
    rounds: int,
    steps: int,
    repeats: int,
    warmup: int = 2,
    spec: dict | None = None,
) -> list[dict]:
    """Each configuration: ``repeats`` timing launches, ``repeats`` memory launches per side."""
    spec = spec or GPT
    rows = []
    for strategy in strategies:
        peer = PEERS[strategy]
        for workers in worker_counts:
            timed = [
                paratrain.launch(
                    time_worker, devices=workers, args=(strategy, spec, rounds, steps, warmup)
                )
                for _ in range(repeats)
            ]
            error = timed[0][0]["peer_error"]
            median, ratios = (
                over_launches(
                    [slowest_rank([r["median_s"] for r in t]) for t in timed],
                    ours="paratrain",
                    peer="peer",
                )
                if error is None
                else ({"paratrain": _median_time(timed)}, [])
            )
            systems = [strategy] if error else [strategy, peer]
            memory: dict[str, list[dict]] = {s: [] for s in systems}
            for index in range(repeats):
                for system in systems if index % 2 == 0 else list(reversed(systems)):
                    memory[system].append(measure_memory(system, spec, workers, steps, warmup))
            row = {
                "strategy": strategy,
                "peer": peer,
                "workers": workers,
                "global_batch": spec["global_batch"],
                "repeats": repeats,
                "peer_error": error,
                "median_step_s": median,
                "throughput_ratio": statistics.median(ratios) if ratios else None,
                "throughput_ratio_range": [min(ratios), max(ratios)] if ratios else None,
                "peak_bytes": {
                    ("paratrain" if s == strategy else "peer"): statistics.median(
                        m["peak"] for m in memory[s]
                    )
                    for s in systems
                },
                "held_bytes": {
                    ("paratrain" if s == strategy else "peer"): statistics.median(
                        m["held"] for m in memory[s]
                    )
                    for s in systems
                },
            }
            peak = row["peak_bytes"]
            row["memory_ratio"] = peak["paratrain"] / peak["peer"] if "peer" in peak else None
            rows.append(row)
            if error:
                print(f"NOTE: {peer} did not run on this machine ({error}).", flush=True)
            print(format_row(row), flush=True)
    return rows


def _median_time(timed: list[list[dict]]) -> float:
    return statistics.median(max(r["median_s"]["paratrain"] for r in t) for t in timed)


HEADER = (
    "| paratrain | peer | workers | paratrain ms | peer ms | throughput ratio (range) "
    "| peak MiB paratrain | peak MiB peer | peak ratio | held MiB paratrain | held MiB peer |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    def cell(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "n/a" if value is None else f"{value / scale:.{digits}f}"

    mib = 1024 * 1024
    ms, peak, held = row["median_step_s"], row["peak_bytes"], row["held_bytes"]
    ratio, spread = row["throughput_ratio"], row["throughput_ratio_range"]
    ratio_cell = "n/a" if ratio is None else f"{ratio:.3f} ({spread[0]:.3f}-{spread[1]:.3f})"
    return (
        f"| {row['strategy']} | {row['peer']} | {row['workers']} "
        f"| {cell(ms['paratrain'], 1e-3)} | {cell(ms.get('peer'), 1e-3)} | {ratio_cell} "
        f"| {cell(peak['paratrain'], mib)} | {cell(peak.get('peer'), mib)} "
        f"| {cell(row['memory_ratio'], digits=3)} "
        f"| {cell(held['paratrain'], mib)} | {cell(held.get('peer'), mib)} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="launches per configuration")
    parser.add_argument("--n-layer", type=int, default=None, help="override gpt's n_layer")
    parser.add_argument("--n-embd", type=int, default=None, help="override gpt's n_embd")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    overrides = {"n_layer": args.n_layer, "n_embd": args.n_embd}
    spec = {
        **GPT,
        "options": {**GPT["options"], **{k: v for k, v in overrides.items() if v is not None}},
    }
    if not Path("/proc/self/clear_refs").exists():
        parser.error("the memory measurement reads /proc (Linux); run it on Linux.")
    print(
        f"torch {torch.__version__}, gpt {spec['options']}, global batch {spec['global_batch']}; "
        f"{args.repeats} launch(es) x {args.rounds} rounds x {args.steps} steps; times are "
        "medians over steps (max over ranks), then over launches; memory is resident growth "
        "per worker over the pre-model baseline (see the module docstring)"
    )
    print(HEADER, flush=True)
    rows = run(
        args.strategies,
        args.workers,
        rounds=args.rounds,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        spec=spec,
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
