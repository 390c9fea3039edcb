"""Per-layer costs for pipeline partitioning: parameters, time and saved activations.

``partition`` balances stages by one number per layer; this module measures those
numbers by running a sample through the layers one at a time, the way a pipeline would
(layer ``i``'s output is layer ``i + 1``'s input). Profiling leaves the layers exactly
as it found them: gradients are taken with ``torch.autograd.grad`` (``.grad`` is never
written), buffers such as BatchNorm running statistics are restored, and the random
number generator state is put back so that a seeded run does not change by profiling.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "LayerProfile",
    "detached",
    "param_profiles",
    "profile_layers",
    "storage_key",
    "tensors_in",
]


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs; ``param_profiles`` fills only the parameter fields."""

    param_count: int
    """Elements in the layer's parameters (a parameter shared by two layers counts in both)."""
    param_bytes: int
    """Bytes of those parameters."""
    forward_backward_s: float = 0.0
    """Median seconds of one forward plus backward on the sample; 0.0 when not measured."""
    activation_bytes: int = 0
    """Bytes autograd saves for this layer's backward on the sample (its input included,
    its parameters and buffers excluded), counting each storage once; 0 when not measured."""

    @property
    def measured(self) -> bool:
        """Whether the time and activation fields come from running a sample."""
        return self.forward_backward_s > 0


def _param_profile(layer: nn.Module) -> LayerProfile:
    params = list(layer.parameters())
    return LayerProfile(
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
    )


def param_profiles(layers: Sequence[nn.Module]) -> list[LayerProfile]:
    """Parameter counts and bytes of each layer, without running anything."""
    return [_param_profile(layer) for layer in layers]


def map_output_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor inside tuples, lists and dicts (a
    ``ModelOutput`` too); other objects (a cache, flags) are kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = copy.copy(value)
        for key in list(value):
            mapped[key] = map_output_tensors(value[key], fn)
        return mapped
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(map_output_tensors(item, fn) for item in value)
    return value


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in a layer output (a tensor or a nested tuple/list/dict of them, or a
    Hugging Face ``ModelOutput``)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if hasattr(value, "to_tuple"):  # a ModelOutput
        return tensors_in(value.to_tuple())
    return []


def fresh_leaves(args: tuple) -> tuple:
    """``args`` with each floating-point tensor a fresh leaf that needs a gradient, as a
    pipeline stage's received input does (for a layer measured alone on its recorded
    input)."""
    return tuple(
        v.detach().requires_grad_(True) if isinstance(v, Tensor) and v.is_floating_point() else v
        for v in args
    )


def detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {key: detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detached(item) for item in value)
    return value


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage a saved tensor keeps alive; views share one key."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(tensor), tensor.numel() * tensor.element_size()


@contextmanager
def _preserved(layer: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore the layer's buffers and the RNG state when profiling is over."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in layer.buffers()]
    cuda = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile_one(layer: nn.Module, inputs: Tensor, repeats: int) -> tuple[LayerProfile, Any]:
    """Profile one layer on ``inputs``; return the profile and the layer's output."""
    params = [p for p in layer.parameters() if p.requires_grad]
    owned = {storage_key(t)[0] for t in [*layer.parameters(), *layer.buffers()]}
    # Token ids (integer inputs) get no gradient; float inputs do, as inside a pipeline.
    wants_grad = inputs.is_floating_point() or inputs.is_complex()
    x = inputs.detach().requires_grad_(wants_grad)
    sources = params + ([x] if wants_grad else [])

    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        address, nbytes = storage_key(tensor)
        if address not in owned:
            saved[address] = nbytes
        return tensor

    def run() -> Any:
        out = layer(x)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        if outs and sources:
            torch.autograd.grad(
                outs,
                sources,
                grad_outputs=[torch.ones_like(t) for t in outs],
                allow_unused=True,
            )
        return out

    with torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = run()  # also the warm-up: first calls pay one-off allocation costs
        seconds = []
        for _ in range(repeats):
            _synchronize(x.device)
            start = time.perf_counter()
            run()
            _synchronize(x.device)
            seconds.append(time.perf_counter() - start)
    base = _param_profile(layer)
    profile = LayerProfile(
        param_count=base.param_count,
        param_bytes=base.param_bytes,
        forward_backward_s=statistics.median(seconds),
        activation_bytes=sum(saved.values()),
    )
    return profile, detached(output)


def profile_layers(
    layers: Sequence[nn.Module], sample_input: Tensor, *, repeats: int = 3
) -> list[LayerProfile]:
    """Measure each layer's forward+backward time and saved activations on ``sample_input``.

    Layers run in order where they and the sample already are; each is timed alone, with
    a backward from a gradient of ones shaped like its output (median of ``repeats``
    timed runs after one untimed run). The sample should be one micro-batch, since that
    is what a pipeline stage holds per micro-batch in flight.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, not {repeats!r}.")
    if not isinstance(sample_input, Tensor):
        raise TypeError(
            f"sample_input must be a tensor (one micro-batch), not {type(sample_input).__name__}."
        )
    profiles: list[LayerProfile] = []
    current: Any = sample_input.detach().clone()  # a slice of a bigger batch counts its own bytes
    for index, layer in enumerate(layers):
        if not isinstance(current, Tensor):
            raise TypeError(
                f"layer {index - 1} returned {type(current).__name__}, but profiling passes one "
                "tensor from layer to layer; make each layer return a single tensor."
            )
        with _preserved(layer, current.device):
            profile, current = _profile_one(layer, current, repeats)
        profiles.append(profile)
    return profiles
