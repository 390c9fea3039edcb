"""Cross-entropy on logits split by vocabulary, never gathered (Megatron-LM's
``vocab_parallel_cross_entropy``).

An lm head split by "vocab" (``layers.VocabHead``) leaves each rank the logits of its
range of token ids, ``[start, start + V/t)``. The loss of a token needs three numbers
over the whole vocabulary, and each is a sum or a maximum of per-rank parts, so three
small all-reduces over the tokens replace a gather of ``tokens x V`` logits:

- the maximum logit (all-reduce MAX), subtracted before ``exp`` as ``F.cross_entropy``
  does, so nothing overflows;
- the sum of ``exp`` over the vocabulary, and the target's shifted logit, which only the
  rank owning the target holds (the others contribute 0): one all-reduce SUM of both.

The loss is ``log(sum exp) - target logit`` per token; its gradient is exact and local:
``softmax - onehot(target)`` on this rank's columns, scaled by the token's incoming
gradient, 0 for an ignored token. Every rank ends with the same per-token losses.

Which loss is computed this way (``sharded_loss``): paratrain's own token cross-entropy
(``paratrain.losses.TokenCrossEntropy``: ``(sum, count)``, shift and ignore index kept)
and a function marked ``losses.token_mean`` (``F.cross_entropy``'s mean over the tokens
not -100, as gpt's ``sequence_cross_entropy``). Any other loss (a lambda, Hugging Face's
``outputs.loss``) may read the logits in ways we cannot see, so for it the head gathers
them (the weights' memory is split, the logits' is not) and a line says so; so does a
model with two vocab-split heads, and an engine once a tally (which reads whole logits
for accuracy) is opened on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.losses import TokenCrossEntropy, _logits
from paratrain.parallel.tensor.layers import VocabHead
from paratrain.parallel.tensor.mappings import LOCAL
from paratrain.runtime import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses ``(N,)`` from this rank's logits ``(N, V/t)`` (see the docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        start: int,
        group: ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        peak = logits.detach().max(dim=-1).values
        if group is not LOCAL:
            comm.all_reduce_max(peak, group=group)
        exp = (logits.detach() - peak.unsqueeze(-1)).exp_()
        owned = (targets >= start) & (targets < start + logits.shape[-1])
        local = (targets - start).masked_fill(~owned, 0)
        picked = logits.detach().gather(-1, local.unsqueeze(-1)).squeeze(-1) - peak
        both = torch.stack([exp.sum(dim=-1), picked.masked_fill(~owned, 0.0)])
        if group is not LOCAL:
            comm.all_reduce_sum(both, group=group)
        counted = targets != ignore_index
        losses = (both[0].log() - both[1]).masked_fill(~counted, 0.0)
        exp /= both[0].unsqueeze(-1)  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, owned, counted)
        return losses

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local, owned, counted = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows[owned], local[owned]] -= 1.0
        out *= (grad * counted).unsqueeze(-1)
        return out, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, head: VocabHead, *, ignore_index: int
) -> torch.Tensor:
    """Per-token cross-entropy ``(N,)`` of this rank's logits ``(N, V/t)`` from ``head``
    against whole-vocabulary ``targets`` ``(N,)``; 0 where ``ignore_index``."""
    if logits.shape[-1] != head.out_features:
        raise ValueError(
            f"the loss got logits of {logits.shape[-1]} token ids, but the vocab-split lm head "
            f"gives this rank {head.out_features} of {head.vocab}: the model changes its "
            "head's output before returning it; make the head replicate in tp_plan."
        )
    wrong = (targets != ignore_index) & ((targets < 0) | (targets >= head.vocab))
    if bool(wrong.any()):
        raise ValueError(
            f"a target {int(targets[wrong][0])} lies outside the vocabulary [0, {head.vocab}) "
            f"and is not the ignore index {ignore_index}; fix the labels."
        )
    return _VocabParallelCrossEntropy.apply(
        logits.float(), targets, head.start, head.group, ignore_index
    )


class SummedVocabLoss:
    """``TokenCrossEntropy`` on vocab-split logits: ``(sum, count)``, and its ``count``."""

    def __init__(self, inner: TokenCrossEntropy, head: VocabHead) -> None:
        self.inner, self.head = inner, head

    def __call__(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(outputs)
        if self.inner.shift:
            logits = logits[..., :-1, :]
        aligned = self.inner._aligned(targets).reshape(-1)
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            aligned,
            self.head,
            ignore_index=self.inner.ignore_index,
        )
        return losses.sum(), (aligned != self.inner.ignore_index).sum()

    def count(self, targets: torch.Tensor) -> int:
        return self.inner.count(targets)


class MeanVocabLoss:
    """A ``losses.token_mean`` function on vocab-split logits: the mean over the tokens
    whose target is not -100 (``F.cross_entropy``'s default)."""

    def __init__(self, inner: Any, head: VocabHead) -> None:
        self.inner, self.head = inner, head

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = _logits(outputs)
        if logits.shape[:-1] != targets.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} "
                "plus a trailing vocabulary dimension."
            )
        flat = targets.reshape(-1)
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), flat, self.head, ignore_index=-100
        )
        return losses.sum() / (flat != -100).sum()


def _kind(loss_fn: Any) -> type | None:
    """Which sharded loss computes ``loss_fn`` exactly, or None. A marked function is
    read from its own ``__dict__``: a wrapper that forwards attributes (a tally's
    ``ObservedLoss``) also reads the logits itself, so it is not taken for the loss."""
    if type(loss_fn) is TokenCrossEntropy:
        return SummedVocabLoss
    if getattr(loss_fn, "__dict__", {}).get("token_mean") is True:
        return MeanVocabLoss
    return None


def sharded_loss(
    loss_fn: Any, model: nn.Module, *, speaks: bool | None = None
) -> SummedVocabLoss | MeanVocabLoss | None:
    """The loss to train ``model`` with if it has a vocab-split head whose logits can stay
    split (its head then returns them split); None where the head gathers, said once by
    the worker that ``speaks`` (rank 0 by default; a pipeline names its last stage's
    first member, which holds the head)."""
    heads = [m for m in model.modules() if isinstance(m, VocabHead)]
    if not heads:
        return None
    kind = _kind(loss_fn)
    if kind is None or len(heads) > 1:
        why = (
            f"the model has {len(heads)} vocab-split heads and one loss"
            if kind
            else f"loss_fn ({_name(loss_fn)}) is not paratrain's token cross-entropy"
        )
        _say(
            f"the lm head is split by vocabulary, but {why}, so its logits are gathered on "
            "every rank (the weights' memory is split, the logits' is not); to keep them "
            "split, pass loss_fn=paratrain.losses.causal_lm_cross_entropy (or "
            "token_cross_entropy) with one vocab-split head.",
            speaks,
        )
        return None
    heads[0].gather = False
    return kind(loss_fn, heads[0])


def gathered(loss_fn: Any, *, speaks: bool | None = None) -> Any:
    """``loss_fn`` back as given, its head gathering whole logits again (a tally reads
    them), said by the worker that ``speaks``; a loss not sharded is returned as it is."""
    if isinstance(loss_fn, (SummedVocabLoss, MeanVocabLoss)):
        loss_fn.head.gather = True
        line = "a tally reads whole logits: the vocab-split lm head gathers them from now on."
        _say(line, speaks)
        return loss_fn.inner
    return loss_fn


def _name(loss_fn: Any) -> str:
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def _say(line: str, speaks: bool | None = None) -> None:
    if (comm.rank() == 0) if speaks is None else speaks:
        print(line, flush=True)
