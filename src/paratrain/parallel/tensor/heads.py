"""Attention modules whose shape we recognise, split by heads.

An attention's forward does not trace (Hugging Face's reads its config and dispatches on
it), so what joins q, k and v to the output projection cannot be checked as an MLP's is.
We recognise four shapes and split each by heads, rank ``r`` holding heads
``[r H/t, (r+1) H/t)`` of q and the key-value heads they read:

- ``reference``: our gpt's ``CausalSelfAttention`` (packed ``qkv``, ``proj``), replaced by
  ``HeadParallelAttention``;
- ``nanogpt``: nanoGPT's ``CausalSelfAttention`` (packed ``c_attn``, ``c_proj``,
  ``n_head``); its forward takes the width from its input, so it is replaced by
  ``NanoGPTHeadParallel``, which runs the same operations on the rank's heads;
- ``separate``: Hugging Face's q_proj / k_proj / v_proj / o_proj with ``head_dim`` (Llama,
  Mistral, Qwen2; grouped key-value heads split when ``tensor`` divides their count,
  and where ``tensor`` is a multiple of it kept whole and sliced, each rank computing the
  one key-value head its query heads read, ``KeyValueHeadSlice``);
- ``packed``: GPT-2's ``c_attn`` / ``c_proj`` (``Conv1D``), q, k and v each sliced by
  heads, ``split_size`` and ``num_heads`` set to the slice's.

The last three keep the module and its forward; only the projections are swapped (and the
per-slice head counts set), and ``setup_check`` compares the split module with the whole
one on the first batch before any step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor.attention import (
    HeadParallelAttention,
    NanoGPTHeadParallel,
    is_reference_attention,
)
from paratrain.parallel.tensor.detect import is_conv1d, out_width
from paratrain.parallel.tensor.layers import ColwiseLinear, KeyValueHeadSlice, RowwiseLinear

HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "split_size")
"""Module attributes that count a slice's heads (or its width): divided by ``tensor``."""


@dataclass(frozen=True)
class AttentionShape:
    """A recognised attention: its colwise inputs, rowwise output, head counts."""

    kind: str
    inputs: tuple[str, ...]
    output: str
    heads: int
    kv_heads: int

    def plan_text(self, name: str) -> str:
        """The tp_plan entries that split the attention ``name`` by heads."""
        entries = [f"'{name}.{child}': 'colwise'" for child in self.inputs]
        return "{" + ", ".join([*entries, f"'{name}.{self.output}': 'rowwise'"]) + "}"


def _children_are(module: nn.Module, names: tuple[str, ...], conv1d: bool = False) -> bool:
    kind = is_conv1d if conv1d else (lambda child: isinstance(child, nn.Linear))
    return all(kind(getattr(module, name, None)) for name in names)


def attention_shape(module: nn.Module) -> AttentionShape | None:
    """The shape of ``module`` if it is an attention we can split (see the docstring)."""
    if is_reference_attention(module):
        return AttentionShape("reference", ("qkv",), "proj", module.n_head, module.n_head)
    name = type(module).__name__
    if name == "CausalSelfAttention" and _children_are(module, ("c_attn", "c_proj")):
        if isinstance(getattr(module, "n_head", None), int):
            return AttentionShape("nanogpt", ("c_attn",), "c_proj", module.n_head, module.n_head)
    separate = ("q_proj", "k_proj", "v_proj", "o_proj")
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and _children_are(module, separate):
        heads = module.q_proj.out_features // head_dim
        kv_heads = module.k_proj.out_features // head_dim
        return AttentionShape("separate", separate[:3], "o_proj", heads, kv_heads)
    if (
        _children_are(module, ("c_attn", "c_proj"), conv1d=True)
        and isinstance(getattr(module, "num_heads", None), int)
        and isinstance(getattr(module, "split_size", None), int)
        and not getattr(module, "is_cross_attention", False)
        and out_width(module.c_attn) == 3 * module.split_size
    ):
        return AttentionShape("packed", ("c_attn",), "c_proj", module.num_heads, module.num_heads)
    return None


def check_heads(name: str, shape: AttentionShape, tensor: int) -> None:
    """Refuse a head count that ``tensor`` does not divide, in one sentence."""
    counts = [("query heads", shape.heads), ("key-value heads", shape.kv_heads)]
    if shape.heads == shape.kv_heads:
        counts = [("heads", shape.heads)]
    elif slices_key_values(shape, tensor):
        counts = counts[:1]
    for what, count in counts:
        if count % tensor:
            sliced = " or a multiple of them" if what == "key-value heads" else ""
            raise ValueError(
                f"attention {name!r} has {count} {what}, which tensor={tensor} does not "
                f"divide (each slice must hold whole heads); choose a tensor that divides "
                f"{count}{sliced}, or replicate it by leaving {shape.plan_text(name)} out "
                "of tp_plan."
            )


def slices_key_values(shape: AttentionShape, tensor: int) -> bool:
    """Whether the key-value heads are kept whole and sliced: grouped heads that ``tensor``
    does not divide but is a multiple of, so that each rank's query heads read one."""
    return (
        shape.kind == "separate"
        and shape.kv_heads % tensor != 0
        and tensor % shape.kv_heads == 0
        and shape.heads % tensor == 0
    )


def split_attention(
    module: nn.Module, *, rank: int, tensor: int, group: ProcessGroup | None
) -> nn.Module:
    """``module`` split by heads: the module to put in its place (itself, or its
    replacement where its forward cannot run on a slice)."""
    shape = attention_shape(module)
    if shape.kind == "reference":
        return HeadParallelAttention(module, rank=rank, tensor=tensor, group=group)
    if shape.kind == "nanogpt":
        return NanoGPTHeadParallel(module, rank=rank, tensor=tensor, group=group)
    blocks = 3 if shape.kind == "packed" else 1
    sliced = slices_key_values(shape, tensor)
    for child in shape.inputs:
        layer = getattr(module, child)
        if sliced and child != "q_proj":  # this rank's query heads read one kv head
            head, dim = rank * shape.kv_heads // tensor, module.head_dim
            layer = KeyValueHeadSlice(layer, head=head, head_dim=dim, group=group)
        else:
            layer = ColwiseLinear(layer, rank=rank, tensor=tensor, group=group, blocks=blocks)
        setattr(module, child, layer)
    layer = getattr(module, shape.output)
    setattr(module, shape.output, RowwiseLinear(layer, rank=rank, tensor=tensor, group=group))
    for attribute in HEAD_COUNTS:
        if isinstance(getattr(module, attribute, None), int):
            setattr(module, attribute, getattr(module, attribute) // tensor)
    if sliced:  # every query head of the slice reads its one key-value head
        module.num_key_value_heads = 1
        module.num_key_value_groups = shape.heads // tensor
    return module
