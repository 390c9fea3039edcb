"""What crosses a stage boundary: a tensor, or a tuple/list/dict of tensors and plain values.

A layer may return several tensors (hidden states and an attention mask, a dict of
them), and the next stage must receive exactly that value. The sender flattens it into
its tensors (the *leaves*) and a JSON description of the rest, which it sends once per
round ahead of the leaves (every micro-batch of a round has the same structure, being an
equal split of one batch); the receiver allocates the leaves from the description and
rebuilds the value. JSON rather than pickle: a peer's message is data, never code.

Gradients flow back for the floating-point leaves only (integer ids and boolean masks have
none), in leaf order, which both sides derive from the same description.
"""

from __future__ import annotations

import json
from typing import Any

import torch

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
HEADER_BYTES = 4096
"""Room for the description; a value needing more is refused with a sentence."""
MAX_LEAVES = 64
"""Tensors one stage may pass to the next (each has its own message tag)."""


class StructureError(ValueError):
    """A value that cannot cross a stage boundary; the message says what to change."""


def flatten(value: Any) -> tuple[list[torch.Tensor], Any]:
    """The tensors of ``value`` in a fixed order, and a JSON-able description of the rest."""
    leaves: list[torch.Tensor] = []
    tree = _describe(value, leaves)
    if len(leaves) > MAX_LEAVES:
        raise StructureError(
            f"a stage passes {len(leaves)} tensors to the next, more than {MAX_LEAVES}; "
            "return fewer from the layer before the stage boundary."
        )
    return leaves, tree


def _describe(item: Any, leaves: list[torch.Tensor]) -> Any:
    """``item``'s description, its tensors appended to ``leaves``. A module-level function,
    not a closure over ``leaves``: a nested function that calls itself is a reference
    cycle, and it would keep every flattened activation alive until Python's cyclic
    collector ran (a round's worth of them through the optimizer step)."""
    if isinstance(item, torch.Tensor):
        if item.dtype not in DTYPES:
            raise StructureError(f"pipeline stages cannot pass tensors of dtype {item.dtype}.")
        leaves.append(item)
        return {"tensor": len(leaves) - 1}
    if isinstance(item, dict):
        if not all(isinstance(key, str) for key in item):
            raise StructureError("a dict passed between pipeline stages needs string keys.")
        return {"dict": [[key, _describe(v, leaves)] for key, v in item.items()]}
    if isinstance(item, (tuple, list)):
        return {type(item).__name__: [_describe(v, leaves) for v in item]}
    if item is None or isinstance(item, (bool, int, float, str)):
        return {"value": item}
    raise StructureError(
        f"pipeline stages pass tensors, tuples, lists, dicts and plain values between "
        f"them, not {type(item).__name__}; return one of those from the layer before a "
        "stage boundary."
    )


def unflatten(tree: Any, leaves: list[torch.Tensor]) -> Any:
    """The value ``flatten`` described, with ``leaves`` in place of its tensors."""
    ((kind, content),) = tree.items()
    if kind == "tensor":
        return leaves[content]
    if kind == "dict":
        return {key: unflatten(child, leaves) for key, child in content}
    if kind in ("tuple", "list"):
        children = [unflatten(child, leaves) for child in content]
        return tuple(children) if kind == "tuple" else children
    return content


def encode_header(value: Any, device: torch.device) -> torch.Tensor:
    """The description of ``value`` and its leaves' dtypes and shapes, as a fixed-size
    byte tensor (zero-padded JSON)."""
    leaves, tree = flatten(value)
    spec = {"tree": tree, "leaves": [[DTYPES.index(t.dtype), list(t.shape)] for t in leaves]}
    data = json.dumps(spec, separators=(",", ":")).encode()
    if len(data) > HEADER_BYTES:
        raise StructureError(
            f"the value passed between pipeline stages takes {len(data)} bytes to describe, "
            f"more than {HEADER_BYTES}; pass fewer tensors or plain values across the boundary."
        )
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return header.to(device)


def decode_header(header: torch.Tensor) -> tuple[Any, list[tuple[torch.dtype, list[int]]]]:
    """(tree, [(dtype, shape) per leaf]) from a header ``encode_header`` wrote."""
    raw = bytes(header.cpu().tolist())
    spec = json.loads(raw.rstrip(b"\0").decode())
    return spec["tree"], [(DTYPES[code], shape) for code, shape in spec["leaves"]]


def floating(leaves: list[torch.Tensor]) -> list[int]:
    """Indices of the leaves that carry gradients back (floating point)."""
    return [index for index, leaf in enumerate(leaves) if leaf.is_floating_point()]
