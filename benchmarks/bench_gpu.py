"""The figures only a GPU gives, each against something paratrain did not write.

Parts (``--part``, default all):

- ``overhead``: paratrain dp at one GPU against the plain PyTorch loop on the same model,
  batches and optimizer, alternated step for step in one process (goal: at most 2% slower).
- ``mfu``: gpt in bf16 at a size that fills a good part of the GPU, paratrain dp at one GPU
  and the plain loop, model FLOPs utilisation against the GPU's dense bf16 peak (goal:
  at least 45%). Model FLOPs per token are PaLM's count, ``6 N + 12 L T d`` (Chowdhery et
  al. 2022, appendix B; N every parameter, L layers, T the context, d the width), the
  same convention as nanoGPT's ``estimate_mfu`` and Megatron's papers.
- ``memory``: the planner's predicted peak (``paratrain.predict``) against the CUDA
  allocator's own ``torch.cuda.max_memory_allocated`` over three steps, counted from
  before the model is built, on several configurations (goal: within 10%).
- ``gloo``: which collectives gloo runs on CUDA tensors with two processes on one GPU, and
  an all-reduce through gloo on CUDA tensors against staging through host memory: what a
  mode of several workers sharing one GPU can use (NCCL refuses two ranks on one device).

    python benchmarks/bench_gpu.py --json gpu.json   # on a CUDA machine
    python benchmarks/bench_gpu.py --smoke           # tiny sizes on the CPU: the code runs

Each part prints one table and returns rows; a part that fails prints its traceback and
the others still run, so one short device session yields every figure it can.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain
from paratrain.models import build_model, loss_for
from paratrain.runtime.devices import current_device

DENSE_BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
"""Dense (no sparsity) bf16 tensor-core peak in FLOP/s, from NVIDIA's data sheets (the SXM
parts; the H200 has the H100's compute with more and faster memory)."""


def gpt_options(width: int, layers: int, context: int, vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "block_size": context,
        "n_layer": layers,
        "n_head": max(1, width // 128) if width >= 128 else 2,
        "n_embd": width,
    }


def token_batches(options: dict, batch: int, count: int, device: torch.device) -> list:
    generator = torch.Generator().manual_seed(0)
    shape = (batch, options["block_size"])

    def one() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, options["vocab_size"], shape, generator=generator)
        y = torch.randint(0, options["vocab_size"], shape, generator=generator)
        return x.to(device), y.to(device)

    return [one() for _ in range(count)]


def adam(params):
    return torch.optim.Adam(params, lr=1e-4, fused=torch.cuda.is_available() or None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """The loop a user writes on one GPU: autocast in bf16 where asked, fp32 weights and
    optimizer state (what paratrain's ``precision="bf16"`` also keeps)."""

    def __init__(self, options: dict, device: torch.device, precision: str) -> None:
        torch.manual_seed(0)
        self.model = build_model("gpt", **options).to(device)
        self.optimizer = adam(self.model.parameters())
        self.loss_fn, self.device = loss_for("gpt"), device
        self.dtype = torch.bfloat16 if precision == "bf16" else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()  # the loop a user writes reads the loss: a sync either way


class Paratrain:
    def __init__(self, options: dict, precision: str, **engine_options) -> None:
        torch.manual_seed(0)
        self.engine = paratrain.setup(
            build_model("gpt", **options),
            optimizer=adam,
            loss_fn=loss_for("gpt"),
            strategy="dp",
            precision=precision,
            **engine_options,
        )
        self.device = self.engine.device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.engine.train_step(x, y).loss


def timed_steps(runner, batches: list, device: torch.device) -> list[float]:
    times = []
    for x, y in batches:
        synchronize(device)
        start = time.perf_counter()
        runner.step(x, y)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


# -- overhead ---------------------------------------------------------------------------------


def overhead_worker(options: dict, batch: int, steps: int, rounds: int, precision: str) -> dict:
    ours = Paratrain(options, precision)
    plain = PlainLoop(options, ours.device, precision)
    batches = token_batches(options, batch, steps, ours.device)
    for runner in (ours, plain):
        timed_steps(runner, batches[:3], ours.device)  # warm-up: allocator, cuBLAS plans
    times = {"paratrain": [], "plain": []}
    for index in range(rounds):  # alternate, order swapped every round
        order = [("paratrain", ours), ("plain", plain)]
        for key, runner in order if index % 2 == 0 else reversed(order):
            times[key] += timed_steps(runner, batches, ours.device)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {"median_step_s": medians, "device": str(ours.device)}


def part_overhead(smoke: bool) -> list[dict]:
    configs = [("fp32", 512, 6, 512, 16), ("bf16", 1024, 12, 1024, 8)]
    if smoke:
        configs = [("fp32", 64, 2, 32, 4)]
    rows = []
    for precision, width, layers, context, batch in configs:
        options = gpt_options(width, layers, context, 8192 if not smoke else 64)
        steps, rounds = (4, 2) if smoke else (10, 6)
        result = paratrain.launch(
            overhead_worker, devices=1, args=(options, batch, steps, rounds, precision)
        )[0]
        median = result["median_step_s"]
        row = {
            "precision": precision,
            "width": width,
            "layers": layers,
            "context": context,
            "batch": batch,
            "device": result["device"],
            "paratrain_step_s": median["paratrain"],
            "plain_step_s": median["plain"],
            "overhead": median["paratrain"] / median["plain"] - 1,
        }
        print(
            f"overhead {precision} gpt {width}x{layers} ctx {context} batch {batch} on "
            f"{row['device']}: paratrain {median['paratrain'] * 1e3:.2f} ms, plain "
            f"{median['plain'] * 1e3:.2f} ms, overhead {row['overhead']:+.2%}",
            flush=True,
        )
        rows.append(row)
    return rows


# -- model FLOPs utilisation ----------------------------------------------------------------


def flops_per_token(model: torch.nn.Module, options: dict) -> float:
    parameters = sum(p.numel() for p in model.parameters())
    layers, context, width = options["n_layer"], options["block_size"], options["n_embd"]
    return 6 * parameters + 12 * layers * context * width


def mfu_worker(options: dict, batch: int, steps: int, which: str) -> dict:
    if which == "paratrain":
        runner = Paratrain(options, "bf16")
    else:
        runner = PlainLoop(options, paratrain_device(), "bf16")
    device = runner.device
    model = runner.engine.model if which == "paratrain" else runner.model
    batches = token_batches(options, batch, steps, device)
    timed_steps(runner, batches[:3], device)
    times = timed_steps(runner, batches, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "median_step_s": statistics.median(times),
        "flops_per_token": flops_per_token(model, options),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_allocated": peak,
    }


def device_peak(name: str) -> float | None:
    for key, value in DENSE_BF16_PEAK.items():
        if key in name:
            return value
    return None


def part_mfu(smoke: bool) -> list[dict]:
    width, layers, context, batch, vocab = (2048, 24, 1024, 8, 32768)
    if smoke:
        width, layers, context, batch, vocab = (64, 2, 32, 4, 64)
    options = gpt_options(width, layers, context, vocab)
    rows = []
    for which in ("paratrain", "plain"):
        result = paratrain.launch(mfu_worker, devices=1, args=(options, batch, 10, which))[0]
        tokens_per_s = batch * context / result["median_step_s"]
        achieved = tokens_per_s * result["flops_per_token"]
        peak = device_peak(result["name"])
        row = {
            "runner": which,
            "device": result["name"],
            "parameters": result["parameters"],
            "tokens_per_step": batch * context,
            "median_step_s": result["median_step_s"],
            "tokens_per_s": tokens_per_s,
            "model_tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None,
            "peak_allocated": result["peak_allocated"],
        }
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a (peak unknown)"
        print(
            f"mfu {which}: gpt {result['parameters'] / 1e6:.0f}M params bf16, "
            f"{tokens_per_s:,.0f} tokens/s, {achieved / 1e12:.1f} TFLOP/s of model FLOPs, "
            f"MFU {mfu} on {result['name']}, peak allocated "
            f"{result['peak_allocated'] / 2**30:.1f} GiB",
            flush=True,
        )
        rows.append(row)
    return rows


# -- the planner's memory against the allocator ---------------------------------------------

MEMORY_CONFIGS = [
    # (width, layers, context, batch, precision, recompute)
    (256, 4, 256, 16, "fp32", False),
    (512, 4, 256, 16, "fp32", False),
    (512, 8, 512, 8, "fp32", False),
    (512, 8, 512, 8, "fp32", True),
    (512, 8, 512, 8, "bf16", False),
    (512, 8, 512, 8, "bf16", True),
    (1024, 6, 512, 8, "fp32", False),
    (1024, 6, 512, 8, "bf16", False),
    (1024, 6, 512, 8, "bf16", True),
]


def memory_worker(options: dict, batch: int, precision: str, recompute: bool) -> dict:
    device = paratrain_device()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    ours = Paratrain(options, precision, recompute=recompute)
    for x, y in token_batches(options, batch, 3, ours.device):
        ours.step(x, y)
    synchronize(ours.device)
    if ours.device.type != "cuda":
        return {"allocator_peak": None, "ledger_peak": ours.engine.memory_report()["total"]["peak"]}
    return {
        "allocator_peak": torch.cuda.max_memory_allocated(device) - before,
        "ledger_peak": ours.engine.memory_report()["total"]["peak"],
    }


def paratrain_device() -> torch.device:
    """The device paratrain's engine computes on in this worker (the GPU under NCCL)."""
    return current_device()


def part_memory(smoke: bool) -> list[dict]:
    configs = MEMORY_CONFIGS if not smoke else [(64, 2, 32, 4, "fp32", False)]
    rows = []
    for width, layers, context, batch, precision, recompute in configs:
        options = gpt_options(width, layers, context, 8192 if not smoke else 64)
        torch.manual_seed(0)
        sample = token_batches(options, batch, 1, torch.device("cpu"))[0]
        plan = paratrain.predict(
            build_model("gpt", **options),
            strategy="dp",
            devices=1,
            global_batch=batch,
            optimizer=adam,
            loss_fn=loss_for("gpt"),
            sample=sample,
            precision=precision,
            recompute=recompute,
        )
        measured = paratrain.launch(
            memory_worker, devices=1, args=(options, batch, precision, recompute)
        )[0]
        predicted, allocator = plan.predicted_peak_bytes, measured["allocator_peak"]
        row = {
            "width": width,
            "layers": layers,
            "context": context,
            "batch": batch,
            "precision": precision,
            "recompute": recompute,
            "predicted_peak": predicted,
            "ledger_peak": measured["ledger_peak"],
            "allocator_peak": allocator,
            "predicted_over_allocator": predicted / allocator if allocator else None,
        }
        ratio = f"{row['predicted_over_allocator']:.3f}" if allocator else "n/a (no CUDA)"
        print(
            f"memory gpt {width}x{layers} ctx {context} batch {batch} {precision} "
            f"recompute={recompute}: predicted {predicted / 2**20:.1f} MiB, ledger "
            f"{row['ledger_peak'] / 2**20:.1f} MiB, allocator peak "
            f"{(allocator or 0) / 2**20:.1f} MiB, predicted/allocator {ratio}",
            flush=True,
        )
        rows.append(row)
    return rows


# -- gloo on CUDA tensors, two processes on one GPU -----------------------------------------


def _try(name: str, call) -> str:
    try:
        call()
        return "ok"
    except Exception as error:  # the point is to record which collectives gloo refuses
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def gloo_worker(megabytes: int) -> dict:
    """Staging through host memory is timed first; then each collective on CUDA tensors is
    tried in turn, a barrier after each, and the first failure ends the tries (a gloo pair
    that was handed a device pointer is broken for every later call: "writev ... Bad
    address" on an H200, torch 2.11)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    payload = torch.randn(megabytes * 2**18, device=device)  # 4-byte floats
    timings = {}

    def staged() -> None:
        host = payload.to("cpu")
        dist.all_reduce(host)
        payload.copy_(host)

    timings["staged_through_host_s"] = _median_time(staged, device)
    pinned = torch.empty(payload.shape, pin_memory=device.type == "cuda")

    def staged_pinned() -> None:
        pinned.copy_(payload, non_blocking=True)
        synchronize(device)
        dist.all_reduce(pinned)
        payload.copy_(pinned, non_blocking=True)

    timings["staged_pinned_s"] = _median_time(staged_pinned, device)
    small = torch.ones(1024, device=device) * (rank + 1)
    out = torch.empty(1024 * world, device=device)

    def send_receive() -> None:
        if rank == 0:
            dist.send(small.clone(), dst=1)
        else:
            dist.recv(small.clone(), src=0)

    tries = {
        "all_reduce": lambda: dist.all_reduce(small.clone()),
        "broadcast": lambda: dist.broadcast(small.clone(), src=0),
        "all_gather": lambda: dist.all_gather(list(out.chunk(world)), small.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, small.clone()),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            small[: 1024 // world].clone(), small.clone()
        ),
        "send_recv": send_receive,
    }
    support = {}
    for name, call in tries.items():
        support[name] = _try(name, lambda call=call: (call(), synchronize(device), dist.barrier()))
        if support[name] != "ok":
            break
    if all(outcome == "ok" for outcome in support.values()) and len(support) == len(tries):
        timings["gloo_on_device_s"] = _median_time(lambda: dist.all_reduce(payload), device)
    return {"support": support, "timings": timings, "device": str(device)}


def _median_time(call, device: torch.device, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def part_gloo(smoke: bool) -> list[dict]:
    megabytes = 4 if smoke else 64
    results = paratrain.launch(gloo_worker, devices=2, backend="gloo", args=(megabytes,))
    rows = []
    for rank, result in enumerate(results):
        row = {"rank": rank, "megabytes": megabytes, **result}
        rows.append(row)
    lead = results[0]
    print(f"gloo with two processes on {lead['device']}:", flush=True)
    for name, outcome in lead["support"].items():
        print(f"  {name}: {outcome}", flush=True)
    for name, seconds in lead["timings"].items():
        gbps = megabytes * 2**20 / seconds / 1e9
        print(f"  all_reduce {megabytes} MiB {name}: {seconds * 1e3:.1f} ms ({gbps:.2f} GB/s)")
    return rows


PARTS = {"overhead": part_overhead, "mfu": part_mfu, "memory": part_memory, "gloo": part_gloo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), action="append")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (or --smoke for tiny sizes on the CPU).")
        return 2
    figures, failed = {}, []
    for name in args.part or list(PARTS):
        try:
            figures[name] = PARTS[name](args.smoke)
        except Exception:
            failed.append(name)
            print(f"part {name} failed:\n{traceback.format_exc()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
