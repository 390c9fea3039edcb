"""Hugging Face causal LMs from tiny configs (no downloads), for tests/test_hf_models.py;
spawned workers import these by name."""

from __future__ import annotations

import torch

STEPS, BATCH, LENGTH, VOCAB = 4, 8, 12, 64


def build(kind: str, layers: int = 2) -> torch.nn.Module:
    """GPT-2 (its LM head tied to the token embedding) or a Llama (untied), no dropout,
    with ``layers`` blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=32,
            n_layer=layers,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def batches() -> list[tuple[dict, torch.Tensor]]:
    """Right-padded sequences of uneven length: the attention mask is 0 and the label -100
    on padding, so replicas hold different token counts."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
        lengths = torch.tensor([LENGTH - (row * 3 + step) % (LENGTH - 2) for row in range(BATCH)])
        mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append(({"input_ids": ids, "attention_mask": mask}, labels))
    return out


def optimizer(name: str):
    """torch's plain per-tensor loop asked for explicitly (``foreach=False``), so that no
    engine swaps in the fused kernel (see tests/loss_workers.py for why). AdamW's eps is
    1e-6, not 1e-8: the rows of GPT-2's tied embedding that the padded batches barely
    touch get gradients near 1e-8, where m / (sqrt(v) + eps) turns the last-bit
    difference of adding a weight's two uses (embedding and head) in another order, which
    a replica's all-reduce cannot avoid, into a visible update (1.5e-4 relative after 4
    steps with eps 1e-8, dp against the same 2-part loop; SGD: 2e-7)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    return lambda params: torch.optim.AdamW(
        params, lr=1e-3, eps=1e-6, weight_decay=0.0, foreach=False
    )


def engine(strategy: str, kind: str, opt: str, accumulation: int = 1, layers: int = 2, **options):
    """The model (``layers`` blocks) under ``strategy`` with the (sum, count) token loss."""
    import paratrain
    from paratrain.losses import causal_lm_cross_entropy

    return paratrain.setup(
        build(kind, layers),
        optimizer=optimizer(opt),
        loss_fn=causal_lm_cross_entropy,
        strategy=strategy,
        gradient_accumulation=accumulation,
        **options,
    )


def train(strategy: str, kind: str, opt: str, accumulation: int = 1, **options) -> tuple:
    trained = engine(strategy, kind, opt, accumulation, **options)
    losses = [trained.train_step(x, y).loss for x, y in batches()]
    return trained.state_dict(), losses


def train_sgd(model: torch.nn.Module, strategy: str, **options) -> tuple:
    """``model`` as built by the caller under ``strategy`` with SGD-momentum and the
    (sum, count) token loss, over ``batches()``: the engine and its losses."""
    import paratrain
    from paratrain.losses import causal_lm_cross_entropy

    trained = paratrain.setup(
        model,
        optimizer=optimizer("sgd"),
        loss_fn=causal_lm_cross_entropy,
        strategy=strategy,
        **options,
    )
    return trained, [trained.train_step(x, y).loss for x, y in batches()]


def train_checkpointed(runs: list[tuple]) -> list[tuple]:
    """Each (strategy, kind, options) with Hugging Face's ``gradient_checkpointing_enable()``
    (its blocks recompute their activations in backward, through torch.utils.checkpoint),
    SGD-momentum, no accumulation."""
    results = []
    for strategy, kind, options in runs:
        model = build(kind)
        model.gradient_checkpointing_enable()
        model.train()  # Hugging Face recomputes only in training mode
        trained, losses = train_sgd(model, strategy, **options)
        results.append((trained.state_dict(), losses))
    return results


def train_compiled(runs: list[tuple]) -> list[tuple]:
    """Each (strategy, kind, how, options) with the model compiled ``how``: "whole"
    (``torch.compile(model)``) or "blocks" (each block's ``compile()`` in place), dynamo's
    graphs run as made (backend "eager"), SGD-momentum; the state under the model's own
    names (without the wrapper's ``_orig_mod.``)."""
    from paratrain.parallel.pipeline.split_points import blocks_container

    results = []
    for strategy, kind, how, options in runs:
        torch._dynamo.reset()
        model = build(kind)
        if how == "whole":
            model = torch.compile(model, backend="eager")
        else:
            for block in model.get_submodule(blocks_container(model)):  # the pipeline's cut
                block.compile(backend="eager")
        trained, losses = train_sgd(model, strategy, **options)
        state = {k.replace("_orig_mod.", ""): v for k, v in trained.state_dict().items()}
        results.append((state, losses))
    return results


def train_all(runs: list[tuple]) -> list[tuple]:
    """Every (strategy, kind, optimizer, accumulation, options) in one launch."""
    return [train(s, kind, opt, acc, **options) for s, kind, opt, acc, options in runs]


def train_and_save(runs: list[tuple], directory: str) -> list[tuple]:
    """Each run, its engine then saving a checkpoint into ``directory``."""
    results = []
    for strategy, kind, opt, accumulation, options in runs:
        trained = engine(strategy, kind, opt, accumulation, **options)
        losses = [trained.train_step(x, y).loss for x, y in batches()]
        path = f"{directory}/{strategy}-{kind}-{opt}"
        trained.save_checkpoint(path)
        results.append((trained.state_dict(), losses, path))
    return results


def resume(strategy: str, kind: str, path: str, **options) -> tuple[dict, float]:
    """Load a checkpoint under another strategy and take one more step."""
    resumed = engine(strategy, kind, "adam", **options)
    resumed.load_checkpoint(path)
    x, y = batches()[0]
    return resumed.state_dict(), resumed.train_step(x, y).loss


def train_own_loss(runs: list[tuple]) -> list[tuple] | None:
    """Each (strategy, kind, options) with the labels inside the dict batch and the
    model's own loss (``loss_fn=lambda outputs, _: outputs.loss``, the Hugging Face
    habit), SGD-momentum; rank 0 returns (state, losses) per run."""
    import paratrain
    from paratrain.runtime import comm

    results = []
    for strategy, kind, options in runs:
        engine = paratrain.setup(
            build(kind),
            optimizer=optimizer("sgd"),
            loss_fn=lambda outputs, _: outputs.loss,
            strategy=strategy,
            **options,
        )
        losses = [engine.train_step({**x, "labels": y}, None).loss for x, y in batches()]
        results.append((engine.state_dict(), losses))
    return results if comm.rank() == 0 else None


def eval_own_loss(runs: list[tuple]) -> list[list[float]] | None:
    """Each (strategy, kind, options)'s ``eval_step`` on every batch with the labels
    inside the dict batch and the model's own loss, on ``sharpened(kind)`` (evaluation
    changes nothing); rank 0 returns the losses per run."""
    import paratrain
    from paratrain.runtime import comm

    results = []
    for strategy, kind, options in runs:
        engine = paratrain.setup(
            sharpened(kind),
            optimizer=optimizer("sgd"),
            loss_fn=lambda outputs, _: outputs.loss,
            strategy=strategy,
            **options,
        )
        results.append([engine.eval_step({**x, "labels": y}, None) for x, y in batches()])
    return results if comm.rank() == 0 else None


def sharpened(kind: str) -> torch.nn.Module:
    """The model with its output head 30 times larger, so that its tokens' losses differ
    as a trained model's do (as built they are all near log(VOCAB), and a mean of shares'
    means is then within 1e-4 of the global mean whatever the padding; here 2e-3 off)."""
    model = build(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


def own_loss_train_and_eval(train_runs: list[tuple], eval_runs: list[tuple]) -> tuple | None:
    """``train_own_loss`` then ``eval_own_loss`` in one launch."""
    trained, evaluated = train_own_loss(train_runs), eval_own_loss(eval_runs)
    return None if trained is None else (trained, evaluated)
