"""Worker functions for tests/test_tp.py (spawned workers import them by name)."""

from __future__ import annotations

import torch
from torch import nn

from tests.workers import parity_batches, parity_optimizer

STEPS = 10
GPT = {"vocab_size": 12, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
UPDOWN_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
GPT_VOCAB_PLAN = {
    "0.token": "vocab",
    "*.qkv": "colwise",
    "*.attn.proj": "rowwise",
    "*.fc": "colwise",
    "*.mlp.proj": "rowwise",
}


class UpDownBlock(nn.Module):
    """A user's residual block: LayerNorm, up, ReLU, down (no reference model's class)."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)  # on the replicated output: one mask per group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class UpDownNet(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList([UpDownBlock(16, 32, dropout) for _ in range(2)])
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build(kind: str) -> nn.Module:
    """fp32 models without dropout, identical from the seed on every rank."""
    from paratrain.models import build_model

    torch.manual_seed(1234)
    if kind == "mlp":
        return build_model("mlp", in_features=12, hidden=24, depth=2, classes=5)
    if kind == "gpt":
        return build_model("gpt", **GPT)
    return UpDownNet(dropout=0.2 if kind == "updown_dropout" else 0.0)


def batches(kind: str, steps: int = STEPS):
    if kind != "gpt":
        return parity_batches("mlp", steps)
    generator = torch.Generator().manual_seed(99)
    shape = (8, GPT["block_size"])
    return [
        (
            torch.randint(0, 12, shape, generator=generator),
            torch.randint(0, 12, shape, generator=generator),
        )
        for _ in range(steps)
    ]


def engine(strategy: str, kind: str, opt: str, accumulation: int = 1, **options):
    import paratrain
    from paratrain.models import loss_for
    from paratrain.runtime import comm

    if strategy == "tp" and kind.startswith("updown"):
        options.setdefault("tp_plan", UPDOWN_PLAN)
    if strategy != "tp":  # the reference takes neither
        options.pop("tp_plan", None)
        options.pop("tensor", None)
    model = build(kind)
    if kind == "updown_dropout":  # every worker another stream: tp must make them one
        torch.manual_seed(comm.rank())
    return paratrain.setup(
        model,
        optimizer=parity_optimizer(opt),
        loss_fn=loss_for("gpt" if kind == "gpt" else "mlp"),
        strategy=strategy,
        gradient_accumulation=accumulation,
        **options,
    )


def train(strategy: str, kind: str, opt: str, accumulation: int = 1, **options):
    """10 steps; returns (state, losses, all-reduces forward and backward per step)."""
    from paratrain.parallel.tensor import mappings

    run = engine(strategy, kind, opt, accumulation, **options)
    before = dict(mappings.CALLS)
    losses = [run.train_step(x, y).loss for x, y in batches(kind)]
    calls = {d: (mappings.CALLS[d] - before.get(d, 0)) / STEPS for d in ("forward", "backward")}
    return run.state_dict(), losses, calls


def train_case(strategy: str, case: tuple):
    """``train`` for a case (model, optimizer, accumulation[, engine options])."""
    kind, opt, accumulation, *options = case
    return train(strategy, kind, opt, accumulation, **(options[0] if options else {}))


def parity_worker(cases: list[tuple]) -> list | None:
    """Every case under tp in one launch; rank 0 returns the results."""
    from paratrain.runtime import comm

    results = [train_case("tp", case) for case in cases]
    return results if comm.rank() == 0 else None


def checkpoint_worker(kind: str, opt: str, saved: str, single_dir: str) -> dict | None:
    """tp: 3 steps, save ``saved``, 2 more steps; then a fresh tp loads the single
    engine's checkpoint ``single_dir`` and takes the same 2 steps; then dp loads
    ``saved`` and does too. Returns the three final states and the tp worker's ledger
    after its last step (rank 0)."""
    from paratrain.runtime import comm

    data = batches(kind, 5)
    run = engine("tp", kind, opt)
    for x, y in data[:3]:
        run.train_step(x, y)
    run.save_checkpoint(saved)
    for x, y in data[3:]:
        run.train_step(x, y)
    out = {"tp": run.state_dict()}
    ledger = dict(run.memory.ledger.current)
    for name, strategy, path in (("single_to_tp", "tp", single_dir), ("tp_to_dp", "dp", saved)):
        other = engine(strategy, kind, opt)
        other.load_checkpoint(path)
        for x, y in data[3:]:
            other.train_step(x, y)
        out[name] = other.state_dict()
    return (out, ledger) if comm.rank() == 0 else None
