"""Worker functions for the memory, precision and recompute tests.

Spawned workers import them by name, so they live in an importable module. Each runs
several cases in one launch, because starting workers is the slow part.
"""

from __future__ import annotations

from typing import Any

import torch

from tests import workers

MEMO_STEPS = 12


def memo_batches(kind: str, steps: int = MEMO_STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batch every step, so that a working optimizer must lower the loss."""
    x, y = workers.parity_batches(kind, steps=1)[0]
    return [(x, y)] * steps


def run_engine(strategy: str, kind: str, optimizer: str, batches: str, **options) -> dict[str, Any]:
    """Train under ``strategy`` on the parity model; return what the tests compare."""
    engine = workers.parity_engine(strategy, kind, optimizer, **options)
    initial = engine.state_dict()
    steps = workers.parity_batches(kind) if batches == "parity" else memo_batches(kind)
    stats = [engine.train_step(x, y) for x, y in steps]
    return {
        "initial": initial,
        "state": engine.state_dict(),
        "losses": [s.loss for s in stats],
        "skipped": [s.skipped_steps for s in stats],
        "scales": [s.loss_scale for s in stats],
        "memory": engine.memory.ledger.record(),
    }


def run_cases(strategy: str, cases: list[tuple[tuple, dict]]) -> list[dict[str, Any]]:
    """``run_engine(strategy, *case, **options)`` for each (case, options) pair."""
    return [run_engine(strategy, *case, **options) for case, options in cases]


def pipeline_cases(cases: list[tuple], options: list[dict]) -> list[dict[str, Any]]:
    """Each case under the pipeline engine with its own options (one launch for all)."""
    return [
        run_engine("pipeline", *case, **option) for case, option in zip(cases, options, strict=True)
    ]


def vote_on_overflow() -> list[bool]:
    """Only rank 1's gradient overflows; with a vote every rank skips, without it only 1."""
    import torch.distributed as dist

    from paratrain.parallel.precision import Precision

    bad = float("inf") if dist.get_rank() == 1 else 1.0
    voted = Precision("fp16").unscale_and_check([torch.tensor([bad])])
    alone = Precision("fp16").unscale_and_check([torch.tensor([bad])], synchronized=True)
    return [voted, alone]


def gpu_ledger_worker() -> dict[str, Any]:
    """Two Adam steps of a 21M-parameter mlp under dp on NCCL; the ledger after them."""
    import paratrain
    from paratrain.models import build_model, loss_for

    torch.manual_seed(0)
    engine = paratrain.setup(
        build_model("mlp", in_features=1024, hidden=4096, depth=2, classes=10),
        optimizer=workers.parity_optimizer("adam"),
        loss_fn=loss_for("mlp"),
        strategy="dp",
    )
    torch.cuda.reset_peak_memory_stats(engine.device)
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    for _ in range(2):
        engine.train_step(x, y)
    torch.cuda.synchronize(engine.device)
    record = engine.memory.ledger.record()
    record["device_bytes"] = torch.cuda.get_device_properties(engine.device).total_memory
    record["parameters"] = sum(p.numel() for p in engine.model.parameters())
    return record


def overflowing_step(strategy: str, options: dict) -> None:
    """Train until the memory budget in ``options`` is exceeded (the test expects a raise)."""
    run_engine(strategy, "mlp", "adam", "parity", **options)
