"""A short text sample from a trained character model, for the run summary.

Where the dataset has no text to decode to (``synthetic_tokens``), the sample is the
generated token ids, which still shows whether the model learned the sequences.

Generated in the parent process from the saved checkpoint, so it works the same whichever
strategy trained the model (and proves the checkpoint loads into a plain model).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoints.format import load_model_state
from paratrain.config import TrainConfig
from paratrain.data import DatasetBundle
from paratrain.models import build_model, generate

_IDS_WIDTH = 72  # characters per line of a sample shown as token ids


def sample_text(
    config: TrainConfig, bundle: DatasetBundle, checkpoint: Path, options: dict[str, Any]
) -> str:
    """``config.sample_chars`` tokens continuing the first token of the validation data,
    decoded to text, or shown as token ids where the dataset has no text."""
    model = build_model(config.model, **options)
    model.load_state_dict(load_model_state(checkpoint))
    prompt = bundle.val[0][0][:1].unsqueeze(0)
    generator = torch.Generator().manual_seed(config.seed)
    tokens = generate(
        model,
        prompt,
        config.sample_chars,
        block_size=config.block_size,
        temperature=0.8,
        generator=generator,
    )
    ids = tokens[0].tolist()
    if bundle.decode is None:  # a dataset without text (synthetic_tokens): the ids
        return textwrap.fill(" ".join(map(str, ids)), width=_IDS_WIDTH)
    return bundle.decode(ids)
