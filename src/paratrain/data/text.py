"""A character-level text corpus cut into next-token training windows.

Kept apart from the Shakespeare loader because nothing here depends on which text it
is: any string becomes a vocabulary, an encoder/decoder pair and two
``TensorDataset``\\ s of ``(inputs, targets)`` windows, where ``targets`` is ``inputs``
shifted by one character, the shape a GPT-style model's loss expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

__all__ = ["TextCorpus", "next_token_windows"]


def next_token_windows(tokens: torch.Tensor, block_size: int) -> TensorDataset:
    """Non-overlapping windows of ``block_size`` tokens and the same shifted by one.

    Window ``k`` is ``tokens[k*block_size : (k+1)*block_size]`` with targets one to the
    right, so a window needs ``block_size + 1`` tokens and the last target never reads
    past ``tokens`` (in particular not across a train/validation split).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}.")
    count = max((tokens.numel() - 1) // block_size, 0)
    used = count * block_size
    inputs = tokens[:used].reshape(count, block_size).clone()
    targets = tokens[1 : used + 1].reshape(count, block_size).clone()
    return TensorDataset(inputs, targets)


@dataclass
class TextCorpus:
    """A character vocabulary plus train/validation next-token datasets.

    ``vocab`` is the sorted list of distinct characters, so a token id is a
    character's rank in it and the same text always gives the same ids.
    """

    vocab: list[str]
    train: TensorDataset
    val: TensorDataset
    source: Path | None = None
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index = {char: i for i, char in enumerate(self.vocab)}

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        block_size: int = 64,
        val_fraction: float = 0.1,
        source: Path | None = None,
    ) -> TextCorpus:
        """Build the corpus: the first ``1 - val_fraction`` of the characters train, the
        rest validate (a contiguous split, so validation text was never seen)."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        vocab = sorted(set(text))
        index = {char: i for i, char in enumerate(vocab)}
        tokens = torch.tensor([index[char] for char in text], dtype=torch.long)
        split = int(len(text) * (1.0 - val_fraction))
        train = next_token_windows(tokens[:split], block_size)
        val = next_token_windows(tokens[split:], block_size)
        if len(train) == 0 or (val_fraction > 0 and len(val) == 0):
            raise ValueError(
                f"A text of {len(text)} characters is too short for block_size {block_size} "
                f"with val_fraction {val_fraction}: each split needs at least "
                f"{block_size + 1} characters; use a smaller block_size or a longer text."
            )
        return cls(vocab=vocab, train=train, val=val, source=source)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters, i.e. the model's embedding/output size."""
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (``int64``) of ``text``; every character must be in the vocabulary."""
        try:
            return torch.tensor([self._index[char] for char in text], dtype=torch.long)
        except KeyError as exc:
            raise ValueError(
                f"Character {exc.args[0]!r} is not in this corpus's {self.vocab_size}-character "
                "vocabulary; encode only text made of characters the corpus contains."
            ) from None

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """The text for a 1-D sequence of token ids (the inverse of :meth:`encode`)."""
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else tokens
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is outside this corpus's vocabulary of {self.vocab_size} "
                "characters; decode only ids produced by encode or a model of that size."
            )
        return "".join(self.vocab[i] for i in ids)
