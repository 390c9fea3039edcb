"""How much stale gradients alone cost Adam, in one process: the ps benchmark's control.

``bench_ps.py`` shows asynchronous ps ending at a higher loss than dp at the same number
of samples on the quick-start gpt. This script separates the algorithm from the engine:
it runs the same optimizer steps a 4-worker ps run applies (one Adam step per 8-sample
share of each global batch, the same batches and weights as ``bench_ps.py``) in a single
process, with each gradient computed on the parameters of ``delay`` steps earlier. No
processes, no servers: whatever the loss costs here, staleness costs under Adam.

    python benchmarks/stale_adam.py                  # delays 0, 2 and 4
    python benchmarks/stale_adam.py --delays 0 1 2 3
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from bench_ps import DEFAULT_DATA, global_batches

from paratrain.models import build_model, loss_for


def final_loss(delay: int, args: argparse.Namespace) -> float:
    """Mean loss over the last 4 global batches' shares, gradients ``delay`` steps stale."""
    vocab, batches = global_batches(str(args.data_dir), 64, 32, args.batches)
    config = {"vocab_size": vocab, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
    loss_fn = loss_for("gpt")
    torch.manual_seed(0)
    model = build_model("gpt", **config)
    stale = build_model("gpt", **config)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: list[dict[str, torch.Tensor]] = []
    losses = []
    for inputs, targets in batches:
        for share_in, share_tgt in zip(
            inputs.chunk(args.shares), targets.chunk(args.shares), strict=True
        ):
            history = [*history, copy.deepcopy(model.state_dict())][-(delay + 1) :]
            stale.load_state_dict(history[0])
            stale.zero_grad(set_to_none=True)
            loss = loss_fn(stale(share_in), share_tgt)
            loss.backward()
            for param, computed in zip(model.parameters(), stale.parameters(), strict=True):
                param.grad = computed.grad
            optimizer.step()
            losses.append(loss.item())
    tail = losses[-4 * args.shares :]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", nargs="+", type=int, default=[0, 2, 4])
    parser.add_argument("--batches", type=int, default=80, help="global batches of 32")
    parser.add_argument("--shares", type=int, default=4, help="Adam steps per global batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-dir", default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    if any(delay < 0 for delay in args.delays):
        parser.error("--delays must be 0 or more.")
    print("| gradient staleness (Adam steps) | final loss |\n|---|---|")
    for delay in args.delays:
        print(f"| {delay} | {final_loss(delay, args):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
