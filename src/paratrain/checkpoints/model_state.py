"""Model weights from wherever they were saved, for ``model.load_state_dict``.

``load_model_state(path)`` reads a paratrain checkpoint folder, a run folder (its newest
checkpoint), a PyTorch distributed checkpoint (DCP) folder (``dcp_read``: its model
state, no pickle run), a ``.safetensors`` file, or a ``.pt``/``.pth``/``.bin`` state dict. The
latter are read with ``torch.load(weights_only=True)`` only: a file holding pickled Python
objects is refused, never executed.

Weights saved from a wrapped model carry the wrapper in their names: ``module.`` from
``nn.DataParallel`` and DDP, ``_orig_mod.`` from ``torch.compile``,
``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` from FSDP and activation
checkpointing. Given the ``model`` they are for, ``load_model_state(path, model=model)``
strips those segments where the model's own names lack them, and refuses a state that
still does not fit with one sentence naming the first missing and first unexpected name
(and the prefix that explains them, where one does).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from paratrain.checkpoints.dcp_read import is_dcp_folder, read_dcp_model
from paratrain.checkpoints.format import MANIFEST, Checkpoint, CheckpointError
from paratrain.checkpoints.locate import latest_checkpoint
from paratrain.checkpoints.wrapper_names import ANYWHERE_WRAPPERS
from paratrain.parallel.ties import tied_names

STATE_SUFFIXES = (".pt", ".pth", ".bin")
"""Files read as ``torch.save``d state dicts (``.bin`` is Hugging Face's name)."""

LEADING_WRAPPERS = ("module",)
"""Wrapper segments that only ever lead a name (DataParallel, DDP; nested: module.module.)."""

NESTED_KEYS = ("state_dict", "model_state_dict", "model")
"""Where training scripts commonly put the model's state inside a larger saved dict."""


def load_model_state(
    path: str | os.PathLike, model: torch.nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The model weights at ``path``, as a plain state dict.

    Without ``model``, names are as stored (a paratrain checkpoint's are canonical). With
    ``model``, wrapper prefixes are stripped where the model's names need it, and names
    and shapes are checked against ``model.state_dict()``: what is returned loads with
    ``model.load_state_dict(state, strict=True)``.
    """
    state = read_state(path)
    if model is None:
        return state
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return fit_to(state, expected, source=str(path), ties=tied_names(model))


def read_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor at ``path`` by its stored name (see the module's docstring)."""
    path = Path(path)
    if is_dcp_folder(path):
        return read_dcp_model(path)
    if path.is_dir():
        if not (path / MANIFEST).exists():
            newest = latest_checkpoint(path)
            if newest is None:
                raise CheckpointError(
                    f"{path} is neither a paratrain checkpoint nor a run folder holding one; "
                    "pass a checkpoint folder, a run folder, a DCP folder, or a .safetensors/.pt "
                    "file."
                )
            path = newest
        return Checkpoint(path).model_state()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}.") from None
    if path.suffix in STATE_SUFFIXES:
        return _read_torch_file(path)
    raise CheckpointError(
        f"{path.name} is not a weights file paratrain reads; pass a checkpoint or run folder, "
        f"a .safetensors file, or a {'/'.join(STATE_SUFFIXES)} state dict."
    )


def _read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``d state dict, unpickling tensors and plain containers only."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else "refused"
        raise CheckpointError(
            f"{path} holds Python objects other than tensors, which paratrain never unpickles "
            f"(torch.load with weights_only=True refused it: {reason}); save "
            "model.state_dict() instead of the model or other objects."
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable torch file: {error}.") from None
    if isinstance(loaded, dict):
        for key in NESTED_KEYS:
            if _is_state(loaded.get(key)) and not _is_state(loaded):
                return dict(loaded[key])
        if _is_state(loaded):
            return dict(loaded)
        keys = ", ".join(map(repr, list(loaded)[:6]))
        raise CheckpointError(
            f"{path} is a dict of {keys}, not a state dict of tensors; save model.state_dict() "
            f"(or put it under one of the keys {', '.join(NESTED_KEYS)})."
        )
    raise CheckpointError(
        f"{path} holds a {type(loaded).__name__}, not a state dict; save model.state_dict()."
    )


def _is_state(value: object) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def strip_wrappers(name: str) -> str:
    """``name`` without the segments a wrapper module added (see the module's docstring)."""
    *path, leaf = name.split(".")
    while path and path[0] in LEADING_WRAPPERS:
        path = path[1:]
    return ".".join([*(part for part in path if part not in ANYWHERE_WRAPPERS), leaf])


def fit_to(
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    *,
    source: str,
    ties: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """``state`` renamed to ``expected``'s names (wrappers stripped where that is what makes
    them match), or ``CheckpointError`` naming what does not fit. A name the model ties to
    another (``ties``: alias -> canonical) that the file stores once is filled in, as files
    that drop shared tensors (safetensors, Hugging Face's) store it."""
    if set(state) != set(expected):
        stripped = {strip_wrappers(name): tensor for name, tensor in state.items()}
        # stripped only where that is a renaming (no two names become one) that fits better
        if len(stripped) == len(state) and len(set(stripped) & set(expected)) > len(
            set(state) & set(expected)
        ):
            state = stripped
    for alias, canonical in (ties or {}).items():
        if alias not in state and canonical in state:
            state = {**state, alias: state[canonical]}
    problem = mismatch({name: tuple(t.shape) for name, t in state.items()}, expected, source=source)
    if problem:
        raise CheckpointError(problem)
    return state


def mismatch(
    found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], *, source: str
) -> str | None:
    """One sentence on how the names and shapes ``found`` differ from those a model
    ``expected``, naming the first missing and the first unexpected name and the prefix that
    explains them; None where they agree."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            parts.append(f"missing {missing[0]!r}{more}")
        if unexpected:
            more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
            parts.append(f"unexpected {unexpected[0]!r}{more}")
        hint = _prefix_hint(found, expected)
        return f"{source} does not fit the model: {', '.join(parts)}{hint}."
    for name in expected:  # the model's own order: its first layer first
        if found[name] != expected[name]:
            return (
                f"{source} holds {name!r} of shape {found[name]}, but the model's is "
                f"{expected[name]}: it was saved from a model of another size."
            )
    return None


def _prefix_hint(found: dict[str, object], expected: dict[str, object]) -> str:
    """Where every name on one side is the other side's with one prefix, say so."""
    for longer, shorter, who in ((found, expected, "file"), (expected, found, "model")):
        prefix = _common_prefix(longer, shorter)
        if prefix is None:
            continue
        if who == "file":
            return (
                f"; every name in the file starts with {prefix!r}, which the model's names "
                "lack: strip it from the file's names"
            )
        return (
            f"; every name of the model starts with {prefix!r} (a wrapper), which the file's "
            "names lack: load into the unwrapped model (e.g. model.module)"
        )
    return ""


def _common_prefix(longer: dict[str, object], shorter: dict[str, object]) -> str | None:
    """The one leading segment(s) that turn ``shorter``'s names into ``longer``'s."""
    if not longer or not shorter or len(longer) != len(shorter):
        return None
    first = min(longer)
    for name in shorter:
        if first.endswith("." + name):
            prefix = first[: -len(name)]
            if {prefix + n for n in shorter} == set(longer):
                return prefix
    return None
