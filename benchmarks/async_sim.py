"""Asynchronous ps replayed in one process: what staleness, the staleness-aware rate and
lookahead pulls do to learning, apart from the machine.

``bench_ps.py`` measures asynchronous ps on real processes that share this machine's
cores, where speed and learning are tangled. This script keeps the learning and drops the
machine: four simulated workers, one of them ``--slowdown`` times slower (each step's
length jittered by +-10%, seeded), pull the parameters, compute the gradient of their
share of a global batch (the same model, batches, Adam and learning rate as
``bench_ps.py``) and push it when their step ends; the "server" applies each push as it
arrives at the factor of ``stale_lr``, and with lookahead a pull comes from the engine's own
``PullLookahead``. No processes, no messages: whatever differs between the variants is the
algorithm.

Reported per variant: the training loss (averaged over the last 4 global batches'
samples, as ``bench_ps.py``) once dp's samples were trained, and the samples needed to
reach dp's loss at 80% of its run (``bench_ps.py``'s target), also as a multiple of dp's.
A method that runs ``r`` times dp's samples/s reaches the target in (that multiple / r)
times dp's time.

    python benchmarks/async_sim.py                 # one seed, about 4 minutes
    python benchmarks/async_sim.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys

import torch
from bench_ps import DEFAULT_DATA, global_batches, time_to_target, windowed_loss_at

from paratrain.models import build_model, loss_for
from paratrain.parallel.ps.lookahead import PullLookahead
from paratrain.parallel.ps.stale_lr import lr_factor

WORKERS, SHARE, GLOBAL_BATCH, WINDOW = 4, 8, 32, 128
MODEL = {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
VARIANTS = {
    "ps, constant lr": ("constant", False),
    "ps, lr / (staleness + 1)": ("inverse", False),
    "ps, lr / (staleness + 1), lookahead": ("inverse", True),
}


def flat_gpt(vocab: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The benchmark's gpt (seed 0) with every parameter a view of one flat tensor, as a
    server holds its shard."""
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=vocab, **MODEL)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for param in params:
        param.data = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return model, flat


def train_dp(batches: list, vocab: int, lr: float, samples: int) -> list[tuple[int, float, int]]:
    """``bench_ps.py``'s records, timed in samples: (samples so far, loss, samples)."""
    model, _ = flat_gpt(vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn, records = loss_for("gpt"), []
    for inputs, targets in batches[: samples // GLOBAL_BATCH]:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        records.append(((len(records) + 1) * GLOBAL_BATCH, loss.item(), GLOBAL_BATCH))
    return records


def train_async(
    batches: list, vocab: int, args: argparse.Namespace, policy: str, lookahead: bool, seed: int
) -> list[tuple[int, float, int]]:
    """Event by event: the earliest step to end pushes, the server applies it, that worker
    pulls again. Worker 1 is the slow one, as in ``bench_ps.py``."""
    rng = random.Random(seed)
    server_model, flat = flat_gpt(vocab)
    worker_model, worker_flat = flat_gpt(vocab)
    server_params, worker_params = list(server_model.parameters()), list(worker_model.parameters())
    optimizer = torch.optim.Adam(server_params, lr=args.lr)
    look = PullLookahead([flat]) if lookahead else None
    loss_fn, version, steps, records, events = loss_for("gpt"), 0, [0] * WORKERS, [], []
    pulled: dict[int, tuple[int, torch.Tensor]] = {}

    def pull(worker: int, now: float) -> None:
        params = torch.empty_like(flat)
        if look is not None:
            look.write(worker, [params])
        else:
            params.copy_(flat)
        pulled[worker] = (version, params)
        length = (args.slowdown if worker == 1 else 1.0) * (1 + rng.uniform(-0.1, 0.1))
        heapq.heappush(events, (now + length, worker))

    for worker in range(WORKERS):
        pull(worker, 0.0)
    while len(records) * SHARE < args.ps_samples:
        now, worker = heapq.heappop(events)
        version_pulled, params = pulled[worker]
        inputs, targets = batches[steps[worker] % len(batches)]
        steps[worker] += 1
        share = slice(worker * SHARE, (worker + 1) * SHARE)
        worker_flat.copy_(params)
        worker_model.zero_grad(set_to_none=True)
        loss = loss_fn(worker_model(inputs[share]), targets[share])
        loss.backward()
        staleness = version - version_pulled
        for server_param, worker_param in zip(server_params, worker_params, strict=True):
            server_param.grad = worker_param.grad
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(policy, staleness)
        if look is not None:
            look.note_push(worker, staleness)
            look.before_step()
        optimizer.step()
        version += 1
        records.append(((len(records) + 1) * SHARE, loss.item(), SHARE))
        pull(worker, now)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2560, help="samples dp trains")
    parser.add_argument("--ps-samples", type=int, default=5120, help="samples each ps run")
    parser.add_argument("--slowdown", type=float, default=3.6, help="the slow worker's factor")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--data-dir", default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    count = max(args.samples, args.ps_samples) // GLOBAL_BATCH + 1
    vocab, batches = global_batches(str(args.data_dir), MODEL["block_size"], GLOBAL_BATCH, count)
    dp = train_dp(batches, vocab, args.lr, args.samples)
    target = windowed_loss_at(dp, 0.8 * args.samples, WINDOW)
    dp_needs = time_to_target(dp, target, WINDOW)  # timed in samples: samples to the target
    print(
        f"torch {torch.__version__}; gpt, {WORKERS} simulated workers, worker 1 "
        f"{args.slowdown:g}x slower, Adam {args.lr:g}; target loss {target:.3f} (dp's at 80% "
        f"of {args.samples} samples), seeds {args.seeds}"
    )
    print("| variant | loss at dp's samples | samples to the target | vs dp |")
    print("|---|---|---|---|")
    print(f"| dp | {windowed_loss_at(dp, args.samples, WINDOW):.3f} | {dp_needs} | 1.00x |")
    for name in args.variants:
        policy, lookahead = VARIANTS[name]
        curves = [train_async(batches, vocab, args, policy, lookahead, s) for s in args.seeds]
        losses = [windowed_loss_at(curve, args.samples, WINDOW) for curve in curves]
        needs = [time_to_target(curve, target, WINDOW) for curve in curves]
        reached = [n for n in needs if n is not None]
        need = statistics.median(reached) if len(reached) == len(needs) else None
        ratio = "-" if need is None or not dp_needs else f"{need / dp_needs:.2f}x"
        print(
            f"| {name} | {statistics.median(losses):.3f} | "
            f"{'not reached' if need is None else int(need)} | {ratio} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
