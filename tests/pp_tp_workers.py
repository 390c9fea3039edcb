"""Models nobody here wrote under pipeline x tensor, for tests/test_pp_tp_models.py:
Hugging Face's Llama and GPT-2 and the nanoGPT copy cut at named split points, and
nanoGPT's blocks given as a layer list; spawned workers import these by name."""

from __future__ import annotations

import torch
from torch import nn

from tests import hf_workers, tp_model_workers

SPLIT_POINTS = {
    "llama": ["model.layers.1"],
    "gpt2": ["transformer.h.1"],
    "nanogpt": ["transformer.h.1"],
    "nanogpt_list": ["2"],
}
"""Where the second stage starts: each model's second block (the list's layer 2)."""


class NanoEmbedding(nn.Module):
    """nanoGPT's token and position embeddings, the first layer of its layer list."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
        self.drop = gpt.transformer.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))


def nanogpt_list() -> nn.Sequential:
    """nanoGPT as a layer list: embeddings, its blocks, final norm, the head tied to the
    token embedding (so the tie crosses the stages)."""
    gpt = tp_model_workers.nanogpt()
    return nn.Sequential(NanoEmbedding(gpt), *gpt.transformer.h, gpt.transformer.ln_f, gpt.lm_head)


def build(kind: str) -> nn.Module:
    return nanogpt_list() if kind == "nanogpt_list" else tp_model_workers.build(kind)


def loss_fn(kind: str):
    """The (sum, count) token loss; the layer list's last layer returns the logits."""
    from paratrain.losses import TokenCrossEntropy

    if kind == "nanogpt_list":
        return TokenCrossEntropy(ignore_index=-1)
    return tp_model_workers.loss_fn(kind)


def train(
    strategy: str, kind: str, opt: str, save: str | None = None, **options
) -> tuple[dict, list[float]]:
    """4 steps; with ``save``, a checkpoint written there after them."""
    import paratrain

    engine = paratrain.setup(
        build(kind),
        optimizer=hf_workers.optimizer(opt),
        loss_fn=loss_fn(kind),
        strategy=strategy,
        **options,
    )
    if strategy == "pipeline":  # each stage splits its block's attention and MLP
        plan = engine.tensor_split.plan
        assert len(plan.attention) == 1 and len(plan.splits) >= 2, plan
    data = tp_model_workers.batches(kind.removesuffix("_list"))
    if kind == "nanogpt_list":  # an nn.Sequential takes one input: the token ids
        data = [(x["idx"], y) for x, y in data]
    losses = [engine.train_step(x, y).loss for x, y in data]
    if save is not None:
        engine.save_checkpoint(save)
    return engine.state_dict(), losses


def pipeline_options(kind: str, options: dict) -> dict:
    """2 stages at ``kind``'s split point x tensor 2, 2 micro-batches, ``options`` added."""
    points = SPLIT_POINTS[kind]
    return {"stages": 2, "tensor": 2, "micro_batches": 2, "split_points": points, **options}


def parity_worker(runs: list[tuple], own_loss: list[tuple], directory: str) -> tuple | None:
    """Each (kind, optimizer, options) under the pipeline, its checkpoint saved in
    ``directory`` under the run's index; then the second run's resumed for one more step
    (``hf_workers.resume``: Llama, AdamW) under the same layout; then each (kind, options)
    with the model's own loss (``hf_workers.train_own_loss``); rank 0 returns them."""
    from paratrain.runtime import comm

    results = [
        train("pipeline", kind, opt, save=f"{directory}/{index}", **pipeline_options(kind, o))
        for index, (kind, opt, o) in enumerate(runs)
    ]
    kind, _, options = runs[1]
    resumed = hf_workers.resume(
        "pipeline", kind, f"{directory}/1", **pipeline_options(kind, options)
    )
    own = [("pipeline", kind, pipeline_options(kind, o)) for kind, o in own_loss]
    owned = hf_workers.train_own_loss(own)
    return (results, resumed, owned) if comm.rank() == 0 else None


def replicas_worker(runs: list[tuple]) -> list | None:
    """Each (kind, optimizer) at 2 replicas x 2 stages x tensor 2 (8 workers)."""
    from paratrain.runtime import comm

    results = [train("pipeline", kind, opt, **pipeline_options(kind, {})) for kind, opt in runs]
    return results if comm.rank() == 0 else None
