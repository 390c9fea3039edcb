"""Models that are not layer lists, cut at named split points, for
tests/test_pipeline_split_points.py; spawned workers import these by name."""

from __future__ import annotations

import torch
from torch import nn

import paratrain
from tests import hf_workers

STEPS, BATCH = 4, 8


class Block(nn.Module):
    """A residual block that takes the hidden state and a mask the model computes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.mix(self.norm(hidden))) * mask


class Blocks(nn.Module):
    """Embedding, a ModuleList of blocks, head: the shape of a transformer, no Sequential.
    The forward computes a mask from the inputs and hands it to every block, as Hugging
    Face models hand theirs."""

    def __init__(self, width: int = 16, blocks: int = 4, *, skip: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)
        self.skip = skip

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        start = hidden
        mask = keep.float()
        for block in self.blocks:
            hidden = block(hidden, mask=mask)
        if self.skip:  # the embedding's output read again after the blocks
            hidden = hidden + start
        return self.head(hidden)


def build(skip: bool = False, blocks: int = 4) -> Blocks:
    torch.manual_seed(0)
    return Blocks(blocks=blocks, skip=skip)


def batches() -> list[tuple[dict, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            {
                "x": torch.randn(BATCH, 6, generator=generator),
                "keep": torch.randint(0, 2, (BATCH, 16), generator=generator),
            },
            torch.randn(BATCH, 3, generator=generator),
        )
        for _ in range(STEPS)
    ]


def optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    return lambda params: torch.optim.Adam(params, lr=0.01, foreach=False)


def plain_loop(opt: str, parts: int, blocks: int = 4) -> tuple[dict, list[float]]:
    """One process, the batch backpropagated in ``parts`` consecutive parts, each part's
    mean over ``parts``: the global mean's gradient, accumulated as the engine does."""
    model = build(blocks=blocks)
    optim = optimizer(opt)(model.parameters())
    losses = []
    for inputs, targets in batches():
        optim.zero_grad()
        total = 0.0
        for index in range(parts):
            part = {k: v.chunk(parts)[index] for k, v in inputs.items()}
            loss = nn.functional.mse_loss(model(**part), targets.chunk(parts)[index]) / parts
            loss.backward()
            total += float(loss.detach())
        optim.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_blocks(runs: list[tuple[str, dict]], blocks: int = 4) -> list[tuple[dict, list[float]]]:
    """Each (optimizer, pipeline options) on ``Blocks``: its state and losses."""
    results = []
    for opt, options in runs:
        engine = paratrain.setup(
            build(blocks=blocks),
            optimizer=optimizer(opt),
            loss_fn=nn.functional.mse_loss,
            strategy="pipeline",
            **options,
        )
        losses = [engine.train_step(x, y).loss for x, y in batches()]
        results.append((engine.state_dict(), losses))
    return results


def train_skip() -> None:
    """The model that reads the embedding's output after the blocks: refused."""
    engine = paratrain.setup(
        build(skip=True),
        optimizer=optimizer("sgd"),
        loss_fn=nn.functional.mse_loss,
        strategy="pipeline",
        split_points=["blocks.2"],
    )
    x, y = batches()[0]
    engine.train_step(x, y)


def train_hf(runs: list[tuple], directory: str) -> list[tuple]:
    """Each (kind, optimizer, options) of tests/hf_workers.py under the pipeline, saved."""
    results = []
    for kind, opt, options in runs:
        engine = hf_workers.engine("pipeline", kind, opt, **options)
        losses = [engine.train_step(x, y).loss for x, y in hf_workers.batches()]
        path = f"{directory}/{kind}-{opt}-{len(results)}"
        engine.save_checkpoint(path)
        results.append((engine.state_dict(), losses, path))
    return results
