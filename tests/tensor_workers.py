"""Worker functions for tests/test_tensor_compose.py (spawned workers import them by name):
split layers composed with data parallel, ZeRO and the pipeline."""

from __future__ import annotations

import torch
from torch import nn

from tests import tp_workers
from tests.workers import parity_optimizer

SEQUENTIAL_PLAN = {"*.up": "colwise", "*.down": "rowwise"}
LAYOUT_OPTIONS = (
    "tensor",
    "tp_plan",
    "stages",
    "micro_batches",
    "schedule",
    "balance",
    "virtual_stages",
)
"""What only the parallel engines take: the single-device reference drops them."""


def build(kind: str) -> nn.Module:
    """tp_workers' models, and ``updown_seq``: the user's blocks as a layer list (what
    the pipeline cuts), split by patterns alone."""
    if kind != "updown_seq":
        return tp_workers.build(kind)
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(12, 16),
        tp_workers.UpDownBlock(16, 32),
        tp_workers.UpDownBlock(16, 32),
        nn.Linear(16, 5),
    )


def batches(kind: str, steps: int = tp_workers.STEPS):
    return tp_workers.batches("updown" if kind == "updown_seq" else kind, steps)


def engine(strategy: str, kind: str, opt: str, accumulation: int = 1, **options):
    import paratrain
    from paratrain.models import loss_for

    if strategy == "single":
        options = {k: v for k, v in options.items() if k not in LAYOUT_OPTIONS}
    elif kind.startswith("updown") and options.get("tensor", 1) > 1:
        plan = SEQUENTIAL_PLAN if kind == "updown_seq" else tp_workers.UPDOWN_PLAN
        options.setdefault("tp_plan", plan)
    return paratrain.setup(
        build(kind),
        optimizer=parity_optimizer(opt),
        loss_fn=loss_for("gpt" if kind == "gpt" else "mlp"),
        strategy=strategy,
        gradient_accumulation=accumulation,
        **options,
    )


def train(strategy: str, case: tuple):
    """10 steps of a case (model, optimizer, accumulation, engine options); returns
    (state, losses, tensor all-reduces per step by direction, parameters this worker
    holds)."""
    from paratrain.parallel.tensor import mappings

    kind, opt, accumulation, options = case
    run = engine(strategy, kind, opt, accumulation, **options)
    before = dict(mappings.CALLS)
    losses = [run.train_step(x, y).loss for x, y in batches(kind)]
    steps = tp_workers.STEPS
    calls = {d: (mappings.CALLS[d] - before.get(d, 0)) / steps for d in ("forward", "backward")}
    held = sum(p.numel() for p in run.model.parameters())
    return run.state_dict(), losses, calls, held


def parity_worker(strategy: str, cases: list[tuple]) -> list | None:
    """Every case under ``strategy`` in one launch; rank 0 returns the results."""
    from paratrain.runtime import comm

    results = [train(strategy, case) for case in cases]
    return results if comm.rank() == 0 else None


def held_worker(strategy: str, case: tuple) -> list:
    """Every rank's parameter count and ledger after 1 step of ``case``."""
    kind, opt, accumulation, options = case
    run = engine(strategy, kind, opt, accumulation, **options)
    x, y = batches(kind, 1)[0]
    run.train_step(x, y)
    return [
        sum(p.numel() for p in run.model.parameters()),
        dict(run.memory.ledger.current),
        run.run_metrics(),
    ]


def chain_worker(
    strategy: str, kind: str, opt: str, load: str | None, save: str, steps: list[int], options: dict
) -> dict | None:
    """Load ``load`` (if any), train on the parity batches ``steps`` (indices), save to
    ``save``; rank 0 returns the final state."""
    from paratrain.runtime import comm

    run = engine(strategy, kind, opt, 1, **options)
    if load is not None:
        run.load_checkpoint(load)
    data = batches(kind, max(steps) + 1)
    for index in steps:
        run.train_step(*data[index])
    run.save_checkpoint(save)
    state = run.state_dict()
    return state if comm.rank() == 0 else None


def refusals_worker() -> list[str]:
    import torch.distributed as dist

    import paratrain

    attempts = [
        ("zero3", {"tensor": 2}),
        ("dp", {"tensor": 2, "group": dist.group.WORLD}),
    ]
    out = []
    for strategy, options in attempts:
        try:
            paratrain.setup(
                tp_workers.build("updown"),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                loss_fn=torch.nn.functional.cross_entropy,
                strategy=strategy,
                **options,
            )
        except ValueError as error:
            out.append(str(error))
    return out
