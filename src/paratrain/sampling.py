"""A short text sample from a trained character model, for the run summary.

Generated in the parent process from the saved checkpoint, so it works the same whichever
strategy trained the model (and proves the checkpoint loads into a plain model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint import load_model_state
from paratrain.config import TrainConfig
from paratrain.data import DatasetBundle
from paratrain.models import build_model, generate


def sample_text(
    config: TrainConfig, bundle: DatasetBundle, checkpoint: Path, options: dict[str, Any]
) -> str:
    """``config.sample_chars`` characters continuing the first character of the validation text."""
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
    return bundle.decode(tokens[0].tolist())
