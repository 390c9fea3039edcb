"""The reference gpt's attention split by heads (Megatron's ParallelAttention).

``qkv`` is column-split so that a rank holds whole heads of q, k and v alike (its slice
of each third, see ``ShardSpec.blocks``); attention is per head, so it runs locally on the
rank's heads, and ``proj`` is row-split over the same heads' features, summed by ``g``.
The forward is gpt's ``CausalSelfAttention.forward`` with the local head count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear

REFERENCE_ATTENTION = ("paratrain.models.gpt", "CausalSelfAttention")
"""The class this module replaces, by name: ``parallel`` does not import the models."""


def is_reference_attention(module: nn.Module) -> bool:
    """Whether ``module`` is the reference gpt's attention (whose forward we know)."""
    kind = type(module)
    return (kind.__module__, kind.__qualname__) == REFERENCE_ATTENTION


class HeadParallelAttention(nn.Module):
    """This rank's ``n_head / tensor`` heads of a gpt attention module."""

    def __init__(
        self, attention: nn.Module, *, rank: int, tensor: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.n_head = attention.n_head // tensor
        self.head_dim = attention.qkv.in_features // attention.n_head
        self.qkv = ColwiseLinear(attention.qkv, rank=rank, tensor=tensor, group=group, blocks=3)
        self.proj = RowwiseLinear(attention.proj, rank=rank, tensor=tensor, group=group)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        width = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class NanoGPTHeadParallel(nn.Module):
    """This rank's ``n_head / tensor`` heads of nanoGPT's ``CausalSelfAttention``.

    nanoGPT's forward reads the width from its input (``C``), which a slice does not
    have, so this runs its operations (flash path: ``scaled_dot_product_attention``,
    causal, its dropouts) on the rank's heads; ``setup_check`` compares it with the
    whole module on the first batch. Its ``bias`` buffer (the causal mask of the
    non-flash path) is kept, so the state dict's names do not change."""

    def __init__(
        self, attention: nn.Module, *, rank: int, tensor: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.n_head = attention.n_head // tensor
        self.head_dim = attention.c_attn.in_features // attention.n_head
        self.n_embd = self.n_head * self.head_dim
        self.dropout = float(getattr(attention, "dropout", 0.0))
        self.c_attn = ColwiseLinear(
            attention.c_attn, rank=rank, tensor=tensor, group=group, blocks=3
        )
        self.c_proj = RowwiseLinear(attention.c_proj, rank=rank, tensor=tensor, group=group)
        self.attn_dropout = getattr(attention, "attn_dropout", nn.Identity())
        self.resid_dropout = getattr(attention, "resid_dropout", nn.Identity())
        if isinstance(getattr(attention, "bias", None), torch.Tensor):
            self.register_buffer("bias", attention.bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, self.n_embd)
        return self.resid_dropout(self.c_proj(y))
