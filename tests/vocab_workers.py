"""Vocabulary-split embeddings and lm heads, for tests/test_tp_vocab.py: our gpt (tied and
untied), Hugging Face's GPT-2 (tied) and Llama (untied), padded labels (-100) on uneven
rows; spawned workers import these by name."""

from __future__ import annotations

import torch
from torch import nn

from tests import hf_workers
from tests.tp_model_workers import LLAMA_PLAN

STEPS, BATCH, LENGTH, VOCAB = 4, 8, 12, 64
GPT = {"vocab_size": VOCAB, "block_size": LENGTH, "n_layer": 2, "n_head": 4, "n_embd": 32}
GPT_PLAN = {
    "0.token": "vocab",
    "*.qkv": "colwise",
    "*.attn.proj": "rowwise",
    "*.fc": "colwise",
    "*.mlp.proj": "rowwise",
    "4": "vocab",  # the head: 0 embedding, 1-2 blocks, 3 LayerNorm, 4 head
}
GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "vocab",
}
LLAMA_VOCAB_PLAN = {"model.embed_tokens": "vocab", **LLAMA_PLAN, "lm_head": "vocab"}
PLANS = {"gpt": GPT_PLAN, "gpt_tied": GPT_PLAN, "gpt2": GPT2_PLAN, "llama": LLAMA_VOCAB_PLAN}
HEADS = {"gpt": "4", "gpt_tied": "4", "gpt2": "lm_head", "llama": "lm_head"}


def build(kind: str) -> nn.Module:
    """gpt (``gpt_tied``: head tied to the token embedding), GPT-2 with 4 heads (so that
    tensor 4 divides them; tied), Llama (untied, 2 key-value heads): no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from paratrain.models import build_model

    torch.manual_seed(0)
    if kind.startswith("gpt") and kind != "gpt2":
        return build_model("gpt", **GPT, tie_embeddings=kind == "gpt_tied")
    if kind == "llama":
        return hf_workers.build("llama")
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def batches(kind: str) -> list[tuple]:
    """Hugging Face's padded dict batches (tests/hf_workers.py: mask 0 and label -100 on
    each row's padding, rows of uneven length); gpt takes the ids and next-token targets,
    -100 on the padding."""
    out = hf_workers.batches()
    if kind in ("gpt2", "llama"):
        return out
    return [
        (x["input_ids"], torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], 1)) for x, y in out
    ]


def loss(kind: str, form: str):
    """``summed``: paratrain's (sum, count) token loss (kept split); ``mean``: gpt's own
    ``sequence_cross_entropy`` (marked token_mean: kept split); ``model``: Hugging Face's
    ``outputs.loss`` from labels in the batch (gathered)."""
    from paratrain.losses import causal_lm_cross_entropy, token_cross_entropy
    from paratrain.models.gpt import sequence_cross_entropy

    if form == "mean":
        return sequence_cross_entropy
    if form == "model":
        return lambda outputs, _: outputs.loss
    return causal_lm_cross_entropy if kind in ("gpt2", "llama") else token_cross_entropy


def train(run: tuple, split: bool = True) -> tuple[dict, list[float], dict]:
    """One run (kind, optimizer, loss form, engine options; ``strategy`` among them, tp
    where not given) for ``STEPS`` steps: its state, losses, and (split) what the worker
    holds of the head and which loss it ran."""
    import paratrain

    kind, opt, form, options = run
    options = dict(options)
    strategy = options.pop("strategy", "tp")
    # the reference adds the pipeline's micro-batches as its own parts, in the same order
    parts = {"gradient_accumulation": options.get("micro_batches", 1)}
    model = build(kind)
    engine = paratrain.setup(
        model,
        optimizer=hf_workers.optimizer(opt),
        loss_fn=loss(kind, form),
        strategy=strategy if split else "single",
        **({"tp_plan": PLANS[kind], **options} if split else parts),
    )
    losses = []
    for x, y in batches(kind):
        if form == "model":
            x = {**x, "labels": y}
        losses.append(engine.train_step(x, y).loss)
    return engine.state_dict(), losses, _head(engine, kind) if split else {}


def _head(engine, kind: str) -> dict:
    head = engine.model.get_submodule(HEADS[kind])
    embedding = engine.model.get_input_embeddings() if kind in ("gpt2", "llama") else None
    embedding = embedding or engine.model[0].token
    return {
        "rows": head.weight.shape[0],
        "tied": head.weight is embedding.weight,
        "embedding_rows": embedding.weight.shape[0],
        "loss": type(engine.loss_fn).__name__,
        "gather": head.gather,
    }


def held(engine) -> dict:
    """What this worker holds of the vocabulary split, for any engine (a pipeline stage
    holds the embedding or the head or neither): rows of each (None where absent), whether
    one tensor serves both, whether the head gathers its logits, the loss it trains with."""
    from paratrain.parallel.tensor.layers import VocabEmbedding, VocabHead

    model = getattr(engine, "module", None) or engine.model
    heads = [m for m in model.modules() if isinstance(m, VocabHead)]
    embeddings = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    head = heads[0] if heads else None
    embedding = embeddings[0] if embeddings else None
    return {
        "rows": head.weight.shape[0] if head else None,
        "embedding_rows": embedding.weight.shape[0] if embedding else None,
        "tied": bool(head and embedding and head.weight is embedding.weight),
        "gather": head.gather if head else None,
        "loss": type(engine.loss_fn).__name__,
    }


def composed_worker(runs: list[tuple]) -> tuple:
    """Each run (its engine named in its options) trained; every rank returns its state,
    losses, ``held`` and ``_evaluated``, so that a pipeline's stages can each be asked."""
    import paratrain

    out = []
    for kind, opt, form, options in runs:
        options = dict(options)
        engine = paratrain.setup(
            build(kind),
            optimizer=hf_workers.optimizer(opt),
            loss_fn=loss(kind, form),
            tp_plan=PLANS[kind],
            **options,
        )
        losses = [engine.train_step(x, y).loss for x, y in batches(kind)]
        state, split = engine.state_dict(), held(engine)
        out.append((state, losses, split, _evaluated(engine, kind)))
    return tuple(out)


class _LogitWidth:
    """A tally's metric that reads the logits a loss sees: their width."""

    fields = ("width",)

    def __call__(self, outputs, targets) -> list[float]:
        logits = getattr(outputs, "logits", outputs)  # Hugging Face's output, or a tensor
        return [float(logits.shape[-1])]


def _evaluated(engine, kind: str) -> tuple[float, float, bool | None]:
    """The first batch's eval loss with the logits split, then again once a tally (which
    reads whole logits: their width here) is open, and whether the head then gathers."""
    x, y = batches(kind)[0]
    split = engine.eval_step(x, y)
    with engine.tally(_LogitWidth()):
        whole = engine.eval_step(x, y)
        return split, whole, held(engine)["gather"]


def parity_worker(runs: list[tuple]) -> list | None:
    """Every run in one launch; rank 0 returns the results."""
    from paratrain.runtime import comm

    results = [train(run) for run in runs]
    return results if comm.rank() == 0 else None


def checkpoint_worker(runs: list[tuple], directory: str) -> list | None:
    """Each run trained, then saved to ``directory/<i>``; rank 0 returns the states."""
    import paratrain
    from paratrain.runtime import comm

    states = []
    for index, (kind, opt, form, options) in enumerate(runs):
        engine = paratrain.setup(
            build(kind),
            optimizer=hf_workers.optimizer(opt),
            loss_fn=loss(kind, form),
            strategy="tp",
            tp_plan=PLANS[kind],
            **options,
        )
        for x, y in batches(kind)[:2]:
            engine.train_step(x, y)
        engine.save_checkpoint(f"{directory}/{index}")
        states.append(engine.state_dict())
    return states if comm.rank() == 0 else None
