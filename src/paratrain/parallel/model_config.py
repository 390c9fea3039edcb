"""The model's own configuration, saved with its checkpoints so that an export can give
the weights the file their library builds the model from (Hugging Face's ``config.json``).

Read once when the engine is set up, from the whole model, before any strategy moves
layers away: a model with a ``config`` that has ``to_json_string`` (Hugging Face's
``PretrainedConfig``) or ``to_dict`` giving plain JSON. A model without one (paratrain's
own gpt, mlp, lenet; most hand-written models) saves none, and the export says so.
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn

METADATA_KEY = "model_config"
"""Where a checkpoint's metadata holds the configuration (JSON)."""


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """``model.config`` as JSON data, with the class that reads it (``architectures``, as
    Hugging Face's ``save_pretrained`` records it); None where the model has no such
    config or its ``to_dict`` holds values JSON cannot keep."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string(use_diff=False))
    elif callable(getattr(config, "to_dict", None)):
        data = config.to_dict()
        try:
            data = json.loads(json.dumps(data))
        except (TypeError, ValueError):
            return None
    else:
        return None
    if not isinstance(data, dict):
        return None
    if not data.get("architectures"):
        data["architectures"] = [type(model).__name__]
    return data


def with_model_config(
    metadata: dict[str, Any] | None, config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """A checkpoint's metadata with the model's configuration added where it has one."""
    if config is None:
        return metadata
    return {**(metadata or {}), METADATA_KEY: config}
