"""Token losses that stay exact however a batch is split: they return ``(sum, count)``.

A language-model batch pads its labels with an ignore index (-100) unevenly: one sequence
is short, another long. Its loss is the mean over the real tokens of the WHOLE batch. A
loss that returns each part's own mean cannot give that once the batch is split over
replicas and micro-batches (a token in a sparse part would weigh more); one that returns
the part's summed loss and its token count can, and every paratrain engine then divides
by the global count (see ``paratrain.parallel.loss_reduction``).

    engine = paratrain.setup(model, ..., loss_fn=paratrain.losses.causal_lm_cross_entropy)
    engine.train_step({"input_ids": ids, "attention_mask": mask}, labels)   # labels: -100 pads
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_mean(loss_fn):
    """Mark ``loss_fn(logits, targets)`` as ``F.cross_entropy``'s mean over the tokens
    whose target is not -100 (logits ``(..., vocab)``, targets ``(...)``): a tensor-split
    lm head may then compute it on split logits (``parallel/tensor/vocab_loss.py``)."""
    loss_fn.token_mean = True
    return loss_fn


def _logits(outputs: Any) -> torch.Tensor:
    """The logits of a model's outputs: a tensor, or a ``ModelOutput``/dict holding them."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(outputs).__name__}; token losses need logits (a tensor, or "
        "an output with a .logits or ['logits'] entry)."
    )


class TokenCrossEntropy:
    """Cross-entropy over tokens as ``(summed over the tokens not ignored, their count)``,
    with ``count(targets)`` so that an engine knows the global batch's count before
    backward. ``shift=True`` follows Hugging Face causal LMs: position t predicts label
    t + 1, so give the unshifted labels (the ``input_ids`` with -100 where no loss is
    wanted)."""

    def __init__(self, *, shift: bool = False, ignore_index: int = IGNORE_INDEX) -> None:
        self.shift, self.ignore_index = shift, ignore_index

    def _aligned(self, targets: torch.Tensor) -> torch.Tensor:
        return targets[..., 1:] if self.shift else targets

    def __call__(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(outputs)
        if self.shift:
            logits = logits[..., :-1, :]
        aligned = self._aligned(targets).reshape(-1)
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            aligned,
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return total, (aligned != self.ignore_index).sum()

    def count(self, targets: torch.Tensor) -> int:
        """Tokens that count in ``targets`` (a batch, or any part of one)."""
        return int((self._aligned(targets) != self.ignore_index).sum())


token_cross_entropy = TokenCrossEntropy()
"""Logits ``(..., vocab)`` against aligned targets ``(...)`` (the reference ``gpt``)."""

causal_lm_cross_entropy = TokenCrossEntropy(shift=True)
"""Hugging Face causal LM outputs against their unshifted ``labels``."""
