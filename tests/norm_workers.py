"""Worker functions for the dropout-stream and BatchNorm tests (spawned workers import them).

Models here are built from a seed, as every worker of the README's recipe builds its own:
``dropout_model`` records every dropout mask it draws, ``bn_model`` holds a BatchNorm2d
and a BatchNorm1d so that both layouts (N, C, H, W) and (N, C) are exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.workers import parity_optimizer

BATCH = 16
STEPS = 10


class RecordingDropout(nn.Module):
    """Dropout that keeps each mask it draws (from torch's generator, as ``nn.Dropout``).

    The mask is recorded as soon as it is drawn, before it is used: recompute stops
    replaying a segment once it has the tensors backward saved, so a replay reaches the
    record only if it comes first.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = torch.empty_like(x).bernoulli_(1.0 - self.p)
        self.masks.append(mask.detach().clone())
        return x * mask / (1.0 - self.p)


def dropout_model() -> nn.Sequential:
    """A layer list with two dropout layers, the same weights on every rank."""
    torch.manual_seed(0)  # the README's recipe: the same seed in every worker
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.ReLU(),
        RecordingDropout(0.5),
        nn.Linear(32, 32),
        nn.ReLU(),
        RecordingDropout(0.5),
        nn.Linear(32, 5),
    )


def dropout_blocks_model() -> nn.Sequential:
    """A layer list whose layers hold their dropout beside their weights (``Linear``, ReLU,
    dropout): a recompute that reruns a layer to make its weights' gradients (a split
    backward's W) replays its mask too."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(n, 32), nn.ReLU(), RecordingDropout(0.5)) for n in (12, 32, 32)),
        nn.Linear(32, 5),
    )


def dropout_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(BATCH, 12, generator=generator),
            torch.randint(0, 5, (BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


def masks_of(model: nn.Module) -> list[torch.Tensor]:
    """Every mask the model's dropout layers drew: layer by layer, each in drawing order."""
    masks = []
    for module in model.modules():
        if isinstance(module, RecordingDropout):
            masks.extend(module.masks)
            module.masks.clear()
    return masks


def dropout_run(
    strategy: str,
    options: dict[str, Any],
    steps: tuple[int, int] = (0, STEPS),
    load_from: str | None = None,
    save_to: str | None = None,
    build: Callable[[], nn.Module] = dropout_model,
) -> dict[str, Any]:
    """Train steps [start, end) of the dropout batches; returns masks, state and losses."""
    import paratrain

    model = build()
    engine = paratrain.setup(
        model,
        optimizer=parity_optimizer("sgd"),
        loss_fn=nn.functional.cross_entropy,
        strategy=strategy,
        **options,
    )
    if load_from:
        engine.load_checkpoint(load_from)
    rng_at_start = torch.get_rng_state()
    start, end = steps
    losses = [engine.train_step(x, y).loss for x, y in dropout_batches()[start:end]]
    rng_at_end = torch.get_rng_state()
    if save_to:
        engine.save_checkpoint(save_to)
    return {
        "masks": masks_of(engine.model),
        "state": engine.state_dict(),
        "losses": losses,
        "rng_at_start": rng_at_start,
        "rng_at_end": rng_at_end,
    }


def dropout_runs(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several ``dropout_run`` in one launch (starting workers is the slow part)."""
    return [dropout_run(strategy, options) for strategy, options in cases]


def dropout_block_runs(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``dropout_runs`` on ``dropout_blocks_model``."""
    return [
        dropout_run(strategy, options, build=dropout_blocks_model) for strategy, options in cases
    ]


def uninterrupted_then_saved(strategy: str, checkpoint: str, save_after: int) -> dict[str, Any]:
    """A whole run, then (from the seed again) its first ``save_after`` steps, saved."""
    whole = dropout_run(strategy, {})
    dropout_run(strategy, {}, (0, save_after), save_to=checkpoint)
    return whole


# ---- BatchNorm --------------------------------------------------------------------------


def bn_model() -> nn.Sequential:
    """Conv + BatchNorm2d, then Linear + BatchNorm1d: a small image classifier.

    The layers before a BatchNorm have no bias, as in ResNets: BatchNorm subtracts the
    mean, so such a bias's gradient is zero up to rounding, and Adam, which divides by
    the gradient's size, would turn that rounding into full-size steps that no two
    summation orders agree on.
    """
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 16, bias=False),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )


def bn_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs with a per-channel offset (mean 3, spread 1), as raw image data often has."""
    generator = torch.Generator().manual_seed(5)
    return [
        (
            3.0 + torch.randn(BATCH, 2, 4, 4, generator=generator),
            torch.randint(0, 5, (BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


def bn_eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    return (
        3.0 + torch.randn(BATCH, 2, 4, 4, generator=generator),
        torch.randint(0, 5, (BATCH,), generator=generator),
    )


def bn_run(strategy: str, optimizer: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train the BatchNorm model 10 steps; this rank's state, the eval loss, the losses."""
    import paratrain

    engine = paratrain.setup(
        bn_model(),
        optimizer=parity_optimizer(optimizer),
        loss_fn=nn.functional.cross_entropy,
        strategy=strategy,
        **options,
    )
    losses = [engine.train_step(x, y).loss for x, y in bn_batches()]
    eval_loss = engine.eval_step(*bn_eval_batch())
    return {"state": engine.state_dict(), "eval": eval_loss, "losses": losses}


def bn_runs(cases: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several ``bn_run`` in one launch."""
    return [bn_run(*case) for case in cases]


def ddp_bn_run(optimizer: str) -> dict[str, Any]:
    """The same training under torch's DistributedDataParallel (defaults: buffers broadcast).

    Each rank takes its contiguous share of the global batch, as the engines do; DDP
    averages the gradients, so the step is the global-batch mean's. Evaluation is each
    rank's share under ``no_grad``, averaged over the ranks.
    """
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = bn_model()
    ddp = DistributedDataParallel(model)
    opt = parity_optimizer(optimizer)(ddp.parameters())
    size = BATCH // world
    losses = []
    for x, y in bn_batches():
        xs, ys = x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(xs), ys)
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1) / world
        dist.all_reduce(total)
        losses.append(float(total[0]))
    x, y = bn_eval_batch()
    ddp.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(
            ddp(x[rank * size : (rank + 1) * size]), y[rank * size : (rank + 1) * size]
        )
    loss = loss.reshape(1) / world
    dist.all_reduce(loss)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "eval": float(loss[0]), "losses": losses}


def ddp_and_engines(optimizer: str, cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """DDP, then each engine case, in one launch."""
    return {
        "ddp": ddp_bn_run(optimizer),
        "engines": [bn_run(strategy, optimizer, options) for strategy, options in cases],
    }


def bn_setup(strategy: str, options: dict[str, Any]) -> None:
    """``setup`` of the BatchNorm model under ``strategy`` (a test expects it to refuse)."""
    import paratrain

    paratrain.setup(
        bn_model(),
        optimizer=parity_optimizer("sgd"),
        loss_fn=nn.functional.cross_entropy,
        strategy=strategy,
        **options,
    )


def pipeline_bn_run(optimizer: str) -> dict[str, Any]:
    """The BatchNorm model under a pipeline of 2 stages x 2 replicas: this rank's local
    buffers after training and an evaluation, the evaluation loss and the state."""
    import paratrain

    engine = paratrain.setup(
        bn_model(),
        optimizer=parity_optimizer(optimizer),
        loss_fn=nn.functional.cross_entropy,
        strategy="pipeline",
        stages=2,
        micro_batches=2,
    )
    for x, y in bn_batches():
        engine.train_step(x, y)
    eval_loss = engine.eval_step(*bn_eval_batch())
    buffers = {name: b.clone() for name, b in engine.model.named_buffers()}
    return {"buffers": buffers, "eval": eval_loss, "state": engine.state_dict()}
