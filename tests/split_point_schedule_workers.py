"""Models cut at named split points under interleaved 1F1B (``virtual_stages``) and the
zero-bubble schedules, for tests/test_split_point_schedules.py; spawned workers import
these by name."""

from __future__ import annotations

import paratrain
from tests import hf_workers

LAYERS = 4
"""Blocks of the Hugging Face models here: 2 stages x 2 virtual stages, one block each."""


def train_hf(runs: list[tuple], directory: str) -> tuple[list[tuple] | None, list[list[int]]]:
    """Each (kind, optimizer, options) of tests/hf_workers.py with ``LAYERS`` blocks under
    the pipeline, its checkpoint saved in ``directory``, then evaluated on the first
    batch: rank 0's results, and on every
    rank, per run, the chunks a zero-bubble W took whole from their output at least once
    (their graph failed the unit proof; exact either way, only slower)."""
    from paratrain.runtime import comm

    results, whole = [], []
    for kind, opt, options in runs:
        engine = hf_workers.engine("pipeline", kind, opt, layers=LAYERS, **options)
        losses = [engine.train_step(x, y).loss for x, y in hf_workers.batches()]
        path = f"{directory}/{kind}-{opt}-{len(results)}"
        engine.save_checkpoint(path)
        evaluated = engine.eval_step(*hf_workers.batches()[0])
        results.append((engine.state_dict(), losses, path, engine.layout(), evaluated))
        whole.append(sorted(engine.stage_parts.cut_chunks))
    return (results if comm.rank() == 0 else None), whole


def train_one(strategy: str, kind: str, opt: str, **options) -> tuple | None:
    """One run of ``train_hf``'s models without saving (under a tensor degree: the
    split's plan checked to hold each worker's two blocks); rank 0's state and losses."""
    from paratrain.runtime import comm

    engine = hf_workers.engine(strategy, kind, opt, layers=LAYERS, **options)
    if options.get("tensor", 1) > 1:
        assert len(engine.tensor_split.plan.attention) == 2, engine.tensor_split.plan
    losses = [engine.train_step(x, y).loss for x, y in hf_workers.batches()]
    state = engine.state_dict()
    return (state, losses) if comm.rank() == 0 else None


def count_block_calls(blocks: int, options: dict) -> dict[str, int] | None:
    """Steps ``Blocks`` under ``options`` and counts each block's real forward calls on
    this worker, by its inner Linear (a block another chunk holds must run shape-only,
    on its meta twin, whose Linear is another module on meta)."""
    from torch import nn

    from tests import split_workers

    model = split_workers.build(blocks=blocks)
    calls: dict[str, int] = {}

    def count(name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if not module.weight.is_meta:  # meta: another worker's block, or a twin
                calls[name] = calls.get(name, 0) + 1

        return hook

    for index, block in enumerate(model.blocks):
        block.mix.register_forward_hook(count(f"blocks.{index}"))
    engine = paratrain.setup(
        model,
        optimizer=split_workers.optimizer("sgd"),
        loss_fn=nn.functional.mse_loss,
        strategy="pipeline",
        **options,
    )
    for x, y in split_workers.batches():
        engine.train_step(x, y)
    return calls
