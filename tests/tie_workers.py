"""Worker functions for the tied-weight tests (spawned workers import them by name).

Three models whose output layer shares its weight with another layer, each a layer list
so the pipeline can cut it:

- ``gpt``: paratrain's gpt with ``tie_embeddings=True`` (the head is the token embedding).
- ``plain``: plain torch modules, ``Sequential(Embedding, Linear, Tanh, Linear)`` with the
  head's weight set to the embedding's Parameter after construction.
- ``same_stage``: two hidden Linears tied to each other, both on the first of two stages
  (``SAME_STAGE_BALANCE``), so the pipeline needs nothing special for them.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.workers import parity_batches, parity_optimizer

KINDS = ("gpt", "plain", "same_stage")
VOCAB, WIDTH = 11, 16
STAGE_OPTIONS = {
    "gpt": {},
    "plain": {"balance": [2, 2]},
    "same_stage": {"balance": [4, 2]},  # layers 1 and 3 (tied) both on stage 0
}
TIES = {"gpt": ("0.token.weight", "4.weight"), "plain": ("0.weight", "3.weight")}
TIES["same_stage"] = ("1.weight", "3.weight")


def tied_model(kind: str) -> nn.Sequential:
    """The model, tied, built identically from a seed on every rank."""
    torch.manual_seed(1234)
    if kind == "gpt":
        from paratrain.models import build_model

        return build_model(
            "gpt",
            vocab_size=VOCAB,
            block_size=8,
            n_layer=2,
            n_head=2,
            n_embd=WIDTH,
            tie_embeddings=True,
        )
    if kind == "plain":
        model = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH),
            nn.Linear(WIDTH, WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, VOCAB, bias=False),
        )
        model[3].weight = model[0].weight
        return model
    if kind == "same_stage":
        model = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH),
            nn.Linear(WIDTH, WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, VOCAB),
        )
        model[3].weight = model[1].weight
        return model
    raise ValueError(kind)


def is_tied(model: nn.Module, kind: str) -> bool:
    """Whether the model's two tied names are still one tensor."""
    state = model.state_dict()
    first, second = TIES[kind]
    return state[first].data_ptr() == state[second].data_ptr()


def tied_engine(strategy: str, kind: str, optimizer: str, **options):
    import paratrain
    from paratrain.models import loss_for

    if strategy == "pipeline":
        options = {**STAGE_OPTIONS[kind], **options}
    return paratrain.setup(
        tied_model(kind),
        optimizer=parity_optimizer(optimizer),
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        **options,
    )


def tied_train(strategy: str, kind: str, optimizer: str, **options) -> tuple[dict, list[float]]:
    """10 parity steps; the final canonical state and the reported losses."""
    engine = tied_engine(strategy, kind, optimizer, **options)
    losses = [engine.train_step(x, y).loss for x, y in parity_batches("gpt")]
    return engine.state_dict(), losses


def tied_parity_worker(
    cases: list[tuple[str, str, str, dict]],
) -> list[tuple[dict, list[float]]]:
    """Each (strategy, kind, optimizer, options) case in one launch."""
    return [tied_train(strategy, kind, opt, **options) for strategy, kind, opt, options in cases]


def tied_checkpoint_phase(
    strategy: str,
    options: dict,
    kind: str,
    optimizer: str,
    steps: tuple[int, int],
    load_from: str | None,
    save_to: str | None,
) -> tuple[dict, list[float], bool]:
    """Train steps [start, end), resuming from and saving checkpoints.

    Also returns whether the engine's model was still tied after loading (engines that
    hold the whole model as one module; True elsewhere).
    """
    engine = tied_engine(strategy, kind, optimizer, **options)
    tied = True
    if load_from:
        engine.load_checkpoint(load_from)
        assert engine.steps_taken == steps[0], (engine.steps_taken, steps)
        if strategy in ("single", "dp", "zero1", "zero2"):
            tied = is_tied(engine.model, kind)
    start, end = steps
    batches = parity_batches("gpt")[start:end]
    losses = [engine.train_step(x, y).loss for x, y in batches]
    if save_to:
        engine.save_checkpoint(save_to, metadata={"phase": strategy})
    return engine.state_dict(), losses, tied
