"""A nanoGPT-style character-level decoder written as a layer list.

Layout::

    0: Embedding          token + learned position embedding   (B, T) int64 -> (B, T, C)
    1 .. n_layer: Block   pre-LN causal self-attention + MLP    (B, T, C) -> (B, T, C)
    n_layer + 1: LayerNorm(C)
    n_layer + 2: Linear(C, vocab_size, bias=False)               (B, T, C) -> (B, T, vocab)

Every entry between the embedding and the head maps one ``(B, T, C)`` tensor to another,
so a pipeline may cut between any two entries and send a single activation. As in nanoGPT
the head may share its weight with the token embedding (``tie_embeddings=True``); it is
off by default. A tie couples the first and last pipeline stages: the pipeline engine
keeps the two copies equal by summing their gradients, and zero3 shards the two entries
as one unit. No dropout anywhere, so parallel runs equal one device in fp32.

Initialisation follows nanoGPT: every Linear and Embedding weight ~ N(0, 0.02), biases
zero, LayerNorm (1, 0), and the two residual projections of each block ~
N(0, 0.02 / sqrt(2 * n_layer)) so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paratrain.losses import token_mean
from paratrain.models._checks import require_int

INIT_STD = 0.02


def _init_linear(layer: nn.Linear, *, std: float = INIT_STD) -> None:
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class Embedding(nn.Module):
    """Token embedding plus learned position embedding, as one pipeline entry.

    One module rather than two entries because the position embedding needs the sequence
    length of the token ids, which a later entry no longer sees.
    """

    def __init__(self, *, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(block_size, n_embd)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the weights (also lets a strategy materialise a meta-device copy)."""
        nn.init.normal_(self.token.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.position.weight, mean=0.0, std=INIT_STD)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape (B, T), got {tuple(idx.shape)}.")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.block_size}; "
                "crop the context to its last block_size tokens."
            )
        positions = torch.arange(t, device=idx.device)
        return self.token(idx) + self.position(positions)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused input projection.

    ``qkv.weight`` stacks the query, key and value projections in that order (rows
    ``[0, C)``, ``[C, 2C)``, ``[2C, 3C)``); a tensor-parallel split must shard each third
    by heads, not the fused matrix as a whole.

    The projection has no bias: the key bias gets an analytically zero gradient (softmax
    ignores a constant added to every logit of a row), so its computed gradient is pure
    rounding noise that Adam would amplify into lr-sized steps, making any change of
    summation order (another device count, another batch split) visible in the weights.
    """

    def __init__(self, *, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    """Position-wise MLP: C -> 4C -> GELU -> C."""

    def __init__(self, *, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    ``residual_std`` is the init std of the two projections that write into the residual
    stream; the builder passes ``0.02 / sqrt(2 * n_layer)`` as nanoGPT does.
    """

    def __init__(self, *, n_embd: int, n_head: int, residual_std: float = INIT_STD) -> None:
        super().__init__()
        self.residual_std = residual_std
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd=n_embd, n_head=n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = FeedForward(n_embd=n_embd)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the weights with the nanoGPT scheme (see the module docstring)."""
        self.ln_1.reset_parameters()
        self.ln_2.reset_parameters()
        _init_linear(self.attn.qkv)
        _init_linear(self.mlp.fc)
        _init_linear(self.attn.proj, std=self.residual_std)
        _init_linear(self.mlp.proj, std=self.residual_std)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _check_config(
    *, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int
) -> None:
    require_int(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    if n_embd % n_head:
        raise ValueError(
            f"n_embd ({n_embd}) must be divisible by n_head ({n_head}) "
            "so that every head has the same width."
        )


def gpt(
    *,
    vocab_size: int = 65,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """Build the decoder; it maps token ids ``(B, T)``, ``T <= block_size``, to logits.

    The defaults (65 characters, as in tiny-shakespeare) give a ~0.8M parameter model
    that trains on a CPU in minutes; pair it with ``sequence_cross_entropy``.
    ``tie_embeddings=True`` makes the head's weight the token embedding's Parameter
    (``model[-1].weight is model[0].token.weight``), as nanoGPT and GPT-2 do.
    """
    _check_config(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    head = nn.Linear(n_embd, vocab_size, bias=False)
    _init_linear(head)
    embedding = Embedding(vocab_size=vocab_size, block_size=block_size, n_embd=n_embd)
    if tie_embeddings:
        head.weight = embedding.token.weight  # one Parameter, N(0, 0.02) as both would be
    return nn.Sequential(
        embedding,
        *(Block(n_embd=n_embd, n_head=n_head, residual_std=residual_std) for _ in range(n_layer)),
        nn.LayerNorm(n_embd),
        head,
    )


def gpt_tp_plan(*, n_layer: int, vocab: bool = True) -> dict[str, str]:
    """The tensor-parallel plan of ``gpt(n_layer=...)`` written out: attention by heads,
    the MLP as a colwise/rowwise pair, and (``vocab``) the token embedding and the head
    split by vocabulary, tied or not; without ``tp_plan`` the last two stay whole."""
    plan = {
        "*.qkv": "colwise",
        "*.attn.proj": "rowwise",
        "*.fc": "colwise",
        "*.mlp.proj": "rowwise",
    }
    if vocab:
        plan = {"0.token": "vocab", **plan, str(n_layer + 2): "vocab"}
    return plan


def gpt_parameter_count(
    *,
    vocab_size: int = 65,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    tie_embeddings: bool = False,
) -> int:
    """Parameters of ``gpt(**same config)``, by formula, without allocating the model.

    Memory planning needs this for models too large to build on the planning host.
    ``n_head`` does not change the count; it is accepted (and checked) so that one
    config dict serves both functions.
    """
    _check_config(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    c = n_embd
    embedding = vocab_size * c + block_size * c
    # 2 LayerNorms (4C) + qkv (3C^2, no bias) + attn proj (C^2 + C) + fc (4C^2 + 4C)
    # + proj (4C^2 + C)
    block = 12 * c * c + 10 * c
    final_norm = 2 * c
    head = 0 if tie_embeddings else c * vocab_size
    return embedding + n_layer * block + final_norm + head


@token_mean
def sequence_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every (batch, position) pair.

    Equal to ``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))``: every token
    weighs the same, so splitting a batch across devices and averaging equal shares
    gives the single-device loss.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} "
            "plus a trailing vocabulary dimension."
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` tokens after ``prompt`` (B, T); return (B, T + new).

    Runs in eval mode without autograd and restores the model's previous training mode,
    so it can be called from inside a training loop. The context is cropped to the last
    ``block_size`` tokens each step. Pass a seeded ``generator`` (on the logits' device)
    for reproducible samples; ``top_k=1`` gives greedy decoding.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must have shape (B, T) with T >= 1, got {tuple(prompt.shape)}; "
            "use prompt.unsqueeze(0) for a single sequence."
        )
    if prompt.dtype.is_floating_point or prompt.dtype.is_complex:
        raise ValueError(f"prompt must hold integer token ids, got dtype {prompt.dtype}.")
    require_int(minimum=0, max_new_tokens=max_new_tokens)
    require_int(block_size=block_size)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}; use top_k=1 for greedy.")
    if top_k is not None:
        require_int(top_k=top_k)

    was_training = model.training
    model.eval()
    try:
        tokens = prompt
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(tokens[:, -block_size:])[:, -1, :] / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)
                tokens = torch.cat([tokens, next_token.to(tokens.dtype)], dim=1)
    finally:
        model.train(was_training)
    return tokens
