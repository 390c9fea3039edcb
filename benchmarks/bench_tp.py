"""paratrain tensor parallelism against PyTorch's own, side by side in one run.

For each tensor degree (2, 4), one launch builds the same gpt twice in every worker:
paratrain ``strategy="tp"`` (its plan found: attention by heads, the MLP as a
colwise/rowwise pair) and PyTorch's ``parallelize_module`` with ``ColwiseParallel`` on
``attn.qkv`` and ``mlp.fc`` and ``RowwiseParallel`` on ``attn.proj`` and ``mlp.proj``
(DTensor over a 1-D CPU device mesh on gloo), and alternates them round by round on the
same global batch, so machine noise hits both alike. Both run the whole batch on every
worker (no replicas) with Adam as a user writes it.

PyTorch's Colwise split of the fused ``qkv`` cuts its rows into contiguous chunks, which
would give rank 0 all of q and half of k; its attention must also run on the local heads.
So the PyTorch side does what a user of ``parallelize_module`` does: its attention module
reads q, k and v from the local chunk with ``n_head / tensor`` heads, and the qkv rows are
reordered once so that rank r's contiguous chunk holds its heads of q, k and v (the cut
paratrain's ``ShardSpec(blocks=3)`` makes). Both sides then compute the same function
from the same weights: the first step's losses are printed side by side.

Reported: median step time per side, samples/s, the throughput ratio paratrain/PyTorch
(>= 1.0: paratrain at least as fast), and paratrain's all-reduce payload per step per
worker against the analytic figure: each of the ``2 n_layer`` colwise/rowwise pairs
all-reduces one ``batch x context x n_embd`` activation forward (after the rowwise layer)
and one such gradient backward (before the colwise layer), and a ring moves
``2 (tensor - 1) / tensor`` times the payload per worker.

    python benchmarks/bench_tp.py            # tensor 2 and 4, 3 launches each
    python benchmarks/bench_tp.py --quick    # one short launch each
    python benchmarks/bench_tp.py --model llama   # Hugging Face's Llama, tensor 2
                                                  # (bench_tp_llama.py: samples/s, peak memory)
    python benchmarks/bench_tp.py --model llama --fused-adam   # torch's Adam fused too
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from alternation import median_step_times, over_launches, slowest_rank
from bench_tp_llama import LLAMA, LLAMA_HEADER, format_llama_row, run_llama
from torch import nn

import paratrain
from paratrain.models import build_model, loss_for

CONFIG = {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 8, "n_embd": 256}
GLOBAL_BATCH = 16


def make_batches(config: dict, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = (batch, config["block_size"])
    return [
        (
            torch.randint(0, config["vocab_size"], shape, generator=generator),
            torch.randint(0, config["vocab_size"], shape, generator=generator),
        )
        for _ in range(count)
    ]


def fresh_model(config: dict) -> nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", **config)


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


class LocalHeadsAttention(nn.Module):
    """gpt's attention as a user of ``parallelize_module`` writes it: q, k and v read from
    this rank's contiguous chunk of ``qkv``'s output, ``n_head / tensor`` heads each."""

    def __init__(self, attention: nn.Module, tensor: int) -> None:
        super().__init__()
        self.qkv, self.proj = attention.qkv, attention.proj
        self.n_head = attention.n_head // tensor
        self.head_dim = attention.qkv.in_features // attention.n_head
        with torch.no_grad():  # rank r's rows: its heads of q, then of k, then of v
            rows = self.qkv.weight.shape[0]
            blocks = self.qkv.weight.view(3, tensor, rows // (3 * tensor), -1)
            self.qkv.weight.copy_(blocks.transpose(0, 1).reshape(rows, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class TorchTensorParallel:
    """``parallelize_module`` on each block; embedding, LayerNorms and head replicated."""

    def __init__(self, config: dict, tensor: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        self.model = fresh_model(config)
        mesh = init_device_mesh("cpu", (tensor,))
        plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        for block in list(self.model)[1:-2]:
            block.attn = LocalHeadsAttention(block.attn, tensor)
            parallelize_module(block, mesh, plan)
        self.optimizer = adam(self.model.parameters())
        self.loss_fn = loss_for("gpt")
        self.losses: list[float] = []

    def step(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.losses.append(float(loss.detach()))


class Paratrain:
    def __init__(self, config: dict, tensor: int) -> None:
        self.engine = paratrain.setup(
            fresh_model(config),
            optimizer=adam,
            loss_fn=loss_for("gpt"),
            strategy="tp",
            tensor=tensor,
        )
        self.comm_bytes = 0
        self.losses: list[float] = []

    def step(self, x, y) -> None:
        stats = self.engine.train_step(x, y)
        self.comm_bytes = stats.comm_bytes
        self.losses.append(stats.loss)


def bench_worker(config: dict, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    """Settings travel as arguments: spawned workers import this module afresh."""
    tensor = dist.get_world_size()
    ours, theirs = Paratrain(config, tensor), TorchTensorParallel(config, tensor)
    batches = make_batches(config, batch, steps)
    first = batches[0]
    ours.step(*first)  # the same first step from the same weights: the same loss
    theirs.step(*first)
    first_losses = {"paratrain": ours.losses[0], "torch": theirs.losses[0]}
    runners = {"torch": theirs, "paratrain": ours}
    medians = median_step_times(runners, batches, rounds=rounds, warmup=warmup)
    return {"median_s": medians, "comm_bytes": ours.comm_bytes, "first_loss": first_losses}


def analytic_payload_bytes(config: dict, batch: int) -> int:
    """Per step and worker: 2 pairs per block, one forward and one backward all-reduce
    each, of a batch x context x n_embd fp32 activation."""
    activation = batch * config["block_size"] * config["n_embd"] * 4
    return 2 * config["n_layer"] * 2 * activation


def measure(config: dict, batch: int, tensor: int, rounds: int, steps: int) -> dict:
    results = paratrain.launch(bench_worker, devices=tensor, args=(config, batch, rounds, steps, 2))
    return {
        "median": slowest_rank([r["median_s"] for r in results]),
        "comm_bytes": results[0]["comm_bytes"],
        "first_loss": results[0]["first_loss"],
    }


HEADER = (
    "| tensor | torch ms | paratrain ms | paratrain samples/s | paratrain/torch (range) "
    "| first loss paratrain / torch | all-reduce payload/step/worker | analytic payload "
    "| ring traffic/worker |\n|---|---|---|---|---|---|---|---|---|"
)


def run(
    degrees: list[int],
    rounds: int,
    steps: int,
    repeats: int,
    config: dict = CONFIG,
    batch: int = GLOBAL_BATCH,
) -> list[dict]:
    rows = []
    for tensor in degrees:
        launches = [measure(config, batch, tensor, rounds, steps) for _ in range(repeats)]
        median, ratios = over_launches(
            [r["median"] for r in launches], ours="paratrain", peer="torch"
        )
        analytic = analytic_payload_bytes(config, batch)
        row = {
            "tensor": tensor,
            "repeats": repeats,
            "median_step_s": median,
            "samples_per_s": {key: batch / value for key, value in median.items()},
            "paratrain_over_torch": statistics.median(ratios),
            "paratrain_over_torch_range": [min(ratios), max(ratios)],
            "first_loss": launches[0]["first_loss"],
            "allreduce_payload_bytes": launches[0]["comm_bytes"],
            "analytic_payload_bytes": analytic,
            "ring_traffic_bytes": 2 * (tensor - 1) / tensor * launches[0]["comm_bytes"],
        }
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    ms = {key: f"{value * 1e3:.1f}" for key, value in row["median_step_s"].items()}
    low, high = row["paratrain_over_torch_range"]
    loss = row["first_loss"]
    return (
        f"| {row['tensor']} | {ms['torch']} | {ms['paratrain']} "
        f"| {row['samples_per_s']['paratrain']:.1f} "
        f"| {row['paratrain_over_torch']:.3f} ({low:.3f}-{high:.3f}) "
        f"| {loss['paratrain']:.6f} / {loss['torch']:.6f} "
        f"| {row['allreduce_payload_bytes']:,} | {row['analytic_payload_bytes']:,} "
        f"| {row['ring_traffic_bytes']:,.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument(
        "--fused-adam", action="store_true", help="llama: torch's side asks for fused Adam too"
    )
    parser.add_argument("--tensor", nargs="+", type=int, default=None, help="gpt: 2 4; llama: 2")
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="launches per degree")
    parser.add_argument("--quick", action="store_true", help="1 launch of 2 rounds x 3 steps")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rounds, steps, repeats = (2, 3, 1) if args.quick else (args.rounds, args.steps, args.repeats)
    if args.model == "llama":
        degrees = args.tensor or [2]
        return main_llama(degrees, rounds, steps, repeats, args.json, args.fused_adam)
    print(
        f"torch {torch.__version__}, gpt {CONFIG}, global batch {GLOBAL_BATCH}; {repeats} "
        f"launch(es) x {rounds} rounds x {steps} steps; medians over steps, then launches"
    )
    print(HEADER, flush=True)
    rows = run(args.tensor or [2, 4], rounds, steps, repeats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def main_llama(
    degrees: list[int], rounds: int, steps: int, repeats: int, out: Path | None, fused: bool
) -> int:
    print(
        f"torch {torch.__version__}, LlamaForCausalLM {LLAMA}, batch 8 x 128 tokens; "
        f"{repeats} launch(es) x {rounds} rounds x {steps} steps; medians over steps, then "
        "launches; peak: PyTorch's MemTracker over one step, the largest worker; torch's "
        f"Adam {'fused' if fused else 'as torch defaults'}"
    )
    print(LLAMA_HEADER, flush=True)
    rows = []
    for tensor in degrees:
        rows.append(run_llama(tensor, rounds, steps, repeats, fused))
        print(format_llama_row(rows[-1]), flush=True)
    if out:
        out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
