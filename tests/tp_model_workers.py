"""Models nobody here wrote under tensor parallelism, for tests/test_tp_models.py: Hugging
Face's Llama (grouped-query attention, SwiGLU MLP) and GPT-2 (Conv1D, packed c_attn), a
copy of nanoGPT (tests/nanogpt_model.py); spawned workers import these by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests import hf_workers

LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
"""Hugging Face's own ``base_model_tp_plan`` for Llama, under the causal LM's prefix."""
ISSUE_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}
"""Issue 25's plan: q split, k and v whole; it trained another function unchecked."""


def without_key_bias(state: dict) -> dict:
    """``state`` with the key third of each packed attention bias left out (see
    tests/test_tp_models.py: its gradient is zero analytically, noise that Adam amplifies)."""
    out = dict(state)
    for name, value in state.items():
        if name.endswith("attn.c_attn.bias"):
            query, _, value_part = value.chunk(3)
            out[name] = torch.cat([query, value_part])
    return out


def nanogpt() -> nn.Module:
    from tests.nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        block_size=hf_workers.LENGTH, vocab_size=hf_workers.VOCAB, n_layer=2, n_head=4, n_embd=32
    )
    return GPT(config)


def build(kind: str) -> nn.Module:
    """nanoGPT, or tests/hf_workers.py's model; ``llama_eager`` runs Hugging Face's eager
    attention, which also returns the per-head weights."""
    if kind == "nanogpt":
        return nanogpt()
    model = hf_workers.build(kind.removesuffix("_eager"))
    if kind.endswith("_eager"):
        model.config._attn_implementation = "eager"
    return model


def batches(kind: str) -> list[tuple]:
    """The padded dict batches of tests/hf_workers.py (attention mask, labels -100 on
    padding); nanoGPT takes ``idx`` and ``targets``, the next tokens (ignored: -1)."""
    out = hf_workers.batches()
    if kind != "nanogpt":
        return out
    shifted = [torch.cat([y[:, 1:], torch.full_like(y[:, :1], -1)], 1) for _, y in out]
    return [
        ({"idx": x["input_ids"], "targets": t.clamp(min=-1)}, t.clamp(min=-1))
        for (x, _), t in zip(out, shifted, strict=True)
    ]


def loss_fn(kind: str):
    """The (sum, count) token loss: exact under replicas whatever their token counts."""
    from paratrain.losses import causal_lm_cross_entropy

    return NanoGPTTokenLoss() if kind == "nanogpt" else causal_lm_cross_entropy


def train(strategy: str, kind: str, opt: str, **options) -> tuple[dict, list[float]]:
    import paratrain

    engine = paratrain.setup(
        build(kind),
        optimizer=hf_workers.optimizer(opt),
        loss_fn=loss_fn(kind),
        strategy=strategy,
        **options,
    )
    losses = [engine.train_step(x, y).loss for x, y in batches(kind)]
    return engine.state_dict(), losses


class NormedHeadsAttention(nn.Module):
    """Hugging Face's attention shape (q/k/v/o_proj, ``head_dim``) whose forward
    normalises the joined heads before ``o_proj``: on a slice of the heads that norm is
    another function, with no error raised. The first-batch check must refuse it."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(width, width) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(F.normalize(y.transpose(1, 2).reshape(b, t, -1), dim=-1))


def refused_by_first_batch() -> str:
    """The setup check's sentence for ``NormedHeadsAttention`` split by heads."""
    import paratrain

    torch.manual_seed(0)
    model = nn.Sequential(NormedHeadsAttention(), nn.Linear(16, 4))
    engine = paratrain.setup(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda out, y: F.cross_entropy(out.reshape(-1, 4), y.reshape(-1)),
        strategy="tp",
    )
    x = torch.randn(4, 6, 16)
    try:
        engine.train_step(x, torch.zeros(4, 6, dtype=torch.long))
    except ValueError as error:
        return str(error)
    return "trained"


def parity_worker(runs: list[tuple], refusal: bool = True) -> list | None:
    """Each (strategy, kind, optimizer, options) in one launch, then (``refusal``) the
    refused attention; rank 0 returns the results."""
    from paratrain.runtime import comm

    results = [train(strategy, kind, opt, **options) for strategy, kind, opt, options in runs]
    if refusal:
        results.append(refused_by_first_batch())
    return results if comm.rank() == 0 else None


class NanoGPTTokenLoss:
    """nanoGPT's logits (``outputs[0]``) against its targets as ``(sum, count)``, -1
    ignored: exact under replicas whatever each share's token count."""

    def __init__(self) -> None:
        from paratrain.losses import TokenCrossEntropy

        self.token = TokenCrossEntropy(ignore_index=-1)

    def __call__(self, outputs, targets):
        return self.token(outputs[0], targets)

    def count(self, targets) -> int:
        return self.token.count(targets)


def configure_optimizers_run(strategy: str) -> tuple[dict, list[float]]:
    """nanoGPT with its own ``configure_optimizers`` (AdamW, weight decay on 2-D
    tensors only) as nanoGPT's users pass it: a factory that ignores what it is given and
    reads the model. eps 1e-6 and the per-tensor loop, as tests/hf_workers.optimizer
    explains (the tied embedding's barely touched rows)."""
    import paratrain

    model = nanogpt()

    def factory(params):
        optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
        for group in optimizer.param_groups:
            group.update(eps=1e-6, foreach=False)
        return optimizer

    engine = paratrain.setup(
        model, optimizer=factory, loss_fn=NanoGPTTokenLoss(), strategy=strategy
    )
    losses = [engine.train_step(x, y).loss for x, y in batches("nanogpt")]
    return engine.state_dict(), losses


def configure_optimizers_worker(strategies: list[str]) -> list | None:
    from paratrain.runtime import comm

    results = [configure_optimizers_run(strategy) for strategy in strategies]
    return results if comm.rank() == 0 else None
