"""What splitting gpt's embedding and lm head by vocabulary saves per worker under tp.

One launch of ``--workers`` workers (tensor = workers) trains the same untied ``gpt``
(a large vocabulary against a narrow width, where the embedding and the head are most of
the model) with Adam three ways, in turn:

- ``replicated``: the blocks split (attention by heads, MLP pairs), embedding and head
  whole on every worker (the plan found without ``tp_plan``);
- ``vocab, gathered``: embedding and head split by vocabulary, the loss a lambda, so
  the head gathers the whole logits on every worker;
- ``vocab, split``: the same split with ``paratrain.losses.token_cross_entropy``: the
  logits stay split and the cross-entropy is computed on them.

For each, per worker: the embedding's and head's bytes held (parameters, gradients and
Adam's two moments: 4 x their parameters), the engine ledger's parameters and peak total
(booked at fixed points), and ``runtime/live_tensors.LiveTensors``'s peak (every live
storage at every operator, temporaries included: an independent count), the largest over
the workers.

    python benchmarks/vocab_memory.py                     # 2 workers, vocab 8192
    python benchmarks/vocab_memory.py --workers 4 --vocab 32768
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import paratrain
from paratrain.losses import token_cross_entropy
from paratrain.models import build_model
from paratrain.runtime.live_tensors import LiveTensors

VARIANTS = ("replicated", "vocab, gathered", "vocab, split")
BLOCKS = {"*.qkv": "colwise", "*.attn.proj": "rowwise", "*.fc": "colwise", "*.mlp.proj": "rowwise"}


def plan(variant: str, n_layer: int) -> dict | None:
    if variant == "replicated":
        return None
    return {"0.token": "vocab", **BLOCKS, str(n_layer + 2): "vocab"}


def measure(variant: str, config: dict, batch: int, steps: int) -> dict:
    """Runs in each worker: one variant's figures for this worker."""
    loss = token_cross_entropy
    if variant == "vocab, gathered":

        def loss(logits, targets):  # a user's mean loss: the head must gather
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    generator = torch.Generator().manual_seed(1)
    shape = (batch, config["block_size"])
    with LiveTensors() as live:
        torch.manual_seed(0)
        model = build_model("gpt", **config)
        engine = paratrain.setup(
            model,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-4, foreach=False),
            loss_fn=loss,
            strategy="tp",
            tp_plan=plan(variant, config["n_layer"]),
        )
        for _ in range(steps):
            x = torch.randint(0, config["vocab_size"], shape, generator=generator)
            y = torch.randint(0, config["vocab_size"], shape, generator=generator)
            engine.train_step(x, y)
    held = {id(p): p for m in (engine.model[0].token, engine.model[-1]) for p in m.parameters()}
    ledger = engine.memory.ledger.record()
    return {
        "vocab_bytes": 4 * sum(p.numel() * p.element_size() for p in held.values()),
        "ledger_parameters": ledger["current"]["parameters"],
        "ledger_peak": ledger["peak_total"],
        "live_peak": live.peak,
    }


def worker(config: dict, batch: int, steps: int) -> dict:
    return {variant: measure(variant, config, batch, steps) for variant in VARIANTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    config = {
        "vocab_size": args.vocab,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": 4,
        "n_embd": args.n_embd,
    }
    results = paratrain.launch(worker, devices=args.workers, args=(config, args.batch, args.steps))
    print(f"gpt {config}, batch {args.batch}, Adam, tp over {args.workers} workers (MiB/worker)")
    print(f"{'':<16} {'embed+head':>10} {'ledger params':>13} {'ledger peak':>11} {'live peak':>9}")
    for variant in VARIANTS:
        row = {k: max(r[variant][k] for r in results) / 2**20 for k in results[0][variant]}
        print(
            f"{variant:<16} {row['vocab_bytes']:>10.1f} {row['ledger_parameters']:>13.1f} "
            f"{row['ledger_peak']:>11.1f} {row['live_peak']:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
