"""The split layers: each holds its rank's slice and says how it was cut (``shard_specs``).

They keep the replaced module's parameter names (``weight``, ``bias``), so the model's
state-dict keys do not change, and its forward's meaning:

- ``ColwiseLinear``: output features split; forward ``f`` then the local matmul, so its
  output is this rank's slice of the features (an elementwise op after it stays local).
  Its bias is split with the rows.
- ``RowwiseLinear``: input features split (it takes a colwise layer's slice); the partial
  products are summed by ``g`` and only then is the bias added, whole and replicated, so
  the bias is counted once and its gradient (the whole output's) is exact on every rank.
- GPT-2's ``Conv1D`` (``x @ weight + bias``, its weight stored (in, out)) splits alike,
  along the other dimension of its weight (``transposed``).
- ``KeyValueHeadSlice``: a key or value projection kept whole on every rank (fewer
  key-value heads than ranks), its output sliced to the one head this rank's query heads
  read; its input and parameters pass ``f``, so their gradients are summed over the ranks.
- ``VocabEmbedding``: rows (token ids) split; a rank looks up the ids it holds, zeros the
  others, and ``g`` sums the ranks' rows.
- ``VocabHead``: an output layer's rows (one per token id) split as the embedding's, so a
  tied pair stays one tensor; its output is this rank's range of the logits, which
  ``vocab_loss`` turns into the cross-entropy without gathering them, or, where the loss
  needs whole logits (``gather``), gathered over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor.detect import in_width, is_conv1d, out_width
from paratrain.parallel.tensor.mappings import (
    copy_to_tensor_group,
    gather_from_tensor_group,
    reduce_from_tensor_group,
)
from paratrain.parallel.tensor.shards import ShardSpec


def _slice_parameter(full: torch.Tensor, spec: ShardSpec, rank: int) -> nn.Parameter:
    return nn.Parameter(spec.take(full.detach(), rank), requires_grad=full.requires_grad)


class ColwiseLinear(nn.Module):
    """This rank's output features of a Linear or Conv1D (``blocks`` > 1: of each fused
    block)."""

    def __init__(
        self, linear: nn.Module, *, rank: int, tensor: int, group: ProcessGroup | None, blocks=1
    ) -> None:
        super().__init__()
        self.group = group
        self.transposed = is_conv1d(linear)
        spec = ShardSpec(dim=int(self.transposed), parts=tensor, blocks=blocks)
        self.shard_specs = {"weight": spec}
        self.weight = _slice_parameter(linear.weight, spec, rank)
        self.bias = None
        if linear.bias is not None:
            self.shard_specs["bias"] = ShardSpec(dim=0, parts=tensor, blocks=blocks)
            self.bias = _slice_parameter(linear.bias, self.shard_specs["bias"], rank)
        self.in_features = in_width(linear)
        self.out_features = out_width(linear) // tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return F.linear(copy_to_tensor_group(x, self.group), weight, self.bias)


class RowwiseLinear(nn.Module):
    """This rank's input features of a Linear or Conv1D; outputs summed, then the whole
    bias added."""

    def __init__(
        self, linear: nn.Module, *, rank: int, tensor: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group = group
        self.transposed = is_conv1d(linear)
        spec = ShardSpec(dim=1 - int(self.transposed), parts=tensor)
        self.shard_specs = {"weight": spec}
        self.weight = _slice_parameter(linear.weight, spec, rank)
        self.bias = linear.bias  # replicated: added once, after the sum
        self.in_features = in_width(linear) // tensor
        self.out_features = out_width(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        out = reduce_from_tensor_group(F.linear(x, weight), self.group)
        return out if self.bias is None else out + self.bias


class KeyValueHeadSlice(nn.Module):
    """A whole key or value projection whose output is cut to key-value head ``head``.

    With fewer key-value heads than ranks (``tensor`` a multiple of their count), the
    query heads of a rank all read one key-value head, which several ranks share: each
    rank keeps the projection whole (replicated, like a norm) and computes only that
    head's features from it. Each rank's gradient of the weight then covers that head's
    rows for its own query heads; ``f`` on the weight and bias sums them over the ranks
    (identity forward, all-reduce backward), so every rank holds the whole gradient, equal
    on each, and the replicas stay equal. ``f`` on the input sums its partial gradient as
    a colwise layer's does."""

    def __init__(
        self, linear: nn.Linear, *, head: int, head_dim: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group = group
        self.weight, self.bias = linear.weight, linear.bias
        self.start, self.end = head * head_dim, (head + 1) * head_dim
        self.in_features, self.out_features = linear.in_features, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_group(self.weight, self.group)[self.start : self.end]
        bias = None
        if self.bias is not None:
            bias = copy_to_tensor_group(self.bias, self.group)[self.start : self.end]
        return F.linear(copy_to_tensor_group(x, self.group), weight, bias)


class VocabEmbedding(nn.Module):
    """This rank's rows of an Embedding; ids outside them contribute zeros before the sum."""

    def __init__(
        self, embedding: nn.Embedding, *, rank: int, tensor: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group = group
        spec = ShardSpec(dim=0, parts=tensor)
        self.shard_specs = {"weight": spec}
        self.weight = _slice_parameter(embedding.weight, spec, rank)
        rows = self.weight.shape[0]
        self.start, self.end = rank * rows, (rank + 1) * rows
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_group(rows, self.group)


class VocabHead(nn.Module):
    """This rank's rows of an output ``nn.Linear`` (logits ``[start, end)`` of the
    vocabulary): ``f`` on its input (its gradient summed over the ranks, as a colwise
    layer's), then the local matmul. ``gather`` (set by ``vocab_loss``) joins the ranks'
    logits for a loss that reads all of them."""

    def __init__(
        self, linear: nn.Linear, *, rank: int, tensor: int, group: ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group, self.rank, self.tensor = group, rank, tensor
        spec = ShardSpec(dim=0, parts=tensor)
        self.shard_specs = {"weight": spec}
        self.weight = _slice_parameter(linear.weight, spec, rank)
        self.bias = None
        if linear.bias is not None:
            self.shard_specs["bias"] = spec
            self.bias = _slice_parameter(linear.bias, spec, rank)
        self.in_features, self.vocab = linear.in_features, linear.out_features
        self.out_features = self.vocab // tensor
        self.start = rank * self.out_features
        self.gather = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(copy_to_tensor_group(x, self.group), self.weight, self.bias)
        if not self.gather:
            return logits
        return gather_from_tensor_group(logits, self.group, rank=self.rank, parts=self.tensor)
