"""Parameter groups under ZeRO, for tests/test_zero_param_groups.py (spawned workers import
these by name)."""

from __future__ import annotations

import torch

from tests.workers import parity_batches, parity_model

STEPS = 5


def split_names(named_parameters) -> tuple[list[str], list[str]]:
    """The standard recipe: decay on matrices, none on biases and norms."""
    named = list(named_parameters)
    decay = [name for name, p in named if p.dim() >= 2 and not name.endswith("bias")]
    return decay, [name for name, _ in named if name not in decay]


def _split(named_parameters) -> tuple[list, list]:
    named = dict(named_parameters)
    decay, rest = split_names(named.items())
    return [named[n] for n in decay], [named[n] for n in rest]


def sgd(named_parameters):
    """SGD-momentum, by name: the groups differ in weight decay and learning rate."""
    decay, rest = _split(named_parameters)
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.1}],
        lr=0.05,
        momentum=0.9,
    )


def adamw(named_parameters):
    """AdamW, by name: decoupled weight decay on one group only."""
    decay, rest = _split(named_parameters)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=0.01,
    )


def adamw_plain(params):
    """The same groups from plain parameters (no names): grouped by shape alone."""
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02},
        ],
        lr=0.01,
    )


FACTORIES = {"sgd": sgd, "adamw": adamw, "adamw_plain": adamw_plain}


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A per-group schedule: LambdaLR refuses a list whose length is not the group count,
    and each group's rate moves differently, so every group must be driven."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [lambda step: 1.0 / (1 + step), lambda step: 0.9**step]
    )


def plain_loop(name: str, ignore_groups: bool = False) -> dict:
    """The single-process loop a user writes, with the same scheduler. ``ignore_groups``
    gives every group the first group's settings: what dropping the groups computes."""
    from paratrain.models import loss_for

    model = parity_model("gpt")
    if name == "adamw_plain":
        optimizer = FACTORIES[name](model.parameters())
    else:
        optimizer = FACTORIES[name](list(model.named_parameters()))
    if ignore_groups:
        first = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        for group in optimizer.param_groups[1:]:
            group.update(first)
    scheduler = schedule(optimizer)
    for x, y in parity_batches("gpt", steps=STEPS):
        optimizer.zero_grad()
        loss_for("gpt")(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine(strategy: str, name: str, **options):
    import paratrain
    from paratrain.models import loss_for

    return paratrain.setup(
        parity_model("gpt"),
        optimizer=FACTORIES[name],
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        **options,
    )


def train(strategy: str, name: str, steps: tuple[int, int] = (0, STEPS), **options) -> dict:
    trained = engine(strategy, name, **options)
    scheduler = schedule(trained.optimizer)
    for x, y in parity_batches("gpt", steps=STEPS)[steps[0] : steps[1]]:
        trained.train_step(x, y)
        scheduler.step()
    return trained.state_dict()


def train_all(runs: list[tuple[str, str, dict]]) -> list[dict]:
    """Every (strategy, factory, options) in one launch (starting workers is slow)."""
    return [train(strategy, name, **options) for strategy, name, options in runs]


def resume_phase(
    strategy: str, name: str, steps: tuple[int, int], load_from: str | None, save_to: str | None
) -> dict:
    """Steps [start, end), resuming the engine and its scheduler from ``load_from``."""
    trained = engine(strategy, name)
    scheduler = schedule(trained.optimizer)
    if load_from:
        trained.load_checkpoint(load_from)  # each group's current rate comes back with it
        scheduler.last_epoch = steps[0]  # the scheduler's own count is the user's to restore
    for x, y in parity_batches("gpt", steps=STEPS)[steps[0] : steps[1]]:
        trained.train_step(x, y)
        scheduler.step()
    if save_to:
        trained.save_checkpoint(save_to)
    return trained.state_dict()
