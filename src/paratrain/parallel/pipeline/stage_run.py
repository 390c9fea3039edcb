"""One stage of a model cut at named split points, run through the model's own forward.

No tracing: every stage calls the whole model as the user does (``model(**batch)``), so
whatever its forward computes between blocks (masks, positions, rotary tables, the
reshapes around the head) is computed by the model's own code. The stage intervenes at
three places only:

- Modules whose state other stages own are moved to the meta device (freeing their
  memory). A stage after the first still meets those of earlier stages on its way to its
  first block; they run shape-only (on meta tensors) and return NaN placeholders of the
  right shape, so that the forward reaches the stage's first block cheaply.
- At its first block (the split point), a forward pre-hook replaces every tensor in the
  block's arguments with the tensors the previous stage sent: the arguments the block
  receives are exactly those it receives on one device.
- At the next stage's first block, a forward pre-hook stops the forward (an exception that
  ``run`` catches) and the tensors among that block's arguments become the stage's output.

Exact when the blocks after a split point depend on earlier stages' parameters only
through the split block's arguments, as the causal LMs of Hugging Face and most block
stacks do. A model that keeps an earlier value aside (a residual from the embedding to the
head) would read a NaN placeholder: the first forward's output is checked for NaN and
refused with a sentence, and a module of another stage called after the split point is
refused when it is called.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.parallel.inputs import as_arguments
from paratrain.parallel.pipeline.partition import PartitionError
from paratrain.parallel.pipeline.split_points import StagePlan
from paratrain.parallel.pipeline.ties import release_shared


class _StageEnd(Exception):  # noqa: N818 - control flow, not an error
    """Raised at the next stage's first block; carries this stage's output."""

    def __init__(self, value: list[torch.Tensor]) -> None:
        super().__init__("stage boundary")
        self.value = value


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor inside tuples, lists and dicts (a
    ``ModelOutput`` too); other objects (a cache, flags) are kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = copy.copy(value)
        for key in list(value):
            mapped[key] = map_tensors(value[key], fn)
        return mapped
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(item, fn) for item in value)
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors ``map_tensors`` visits, in its order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def _placeholder(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(meta: torch.Tensor) -> torch.Tensor:
        if meta.is_floating_point():
            return torch.full(meta.shape, float("nan"), dtype=meta.dtype, device=device)
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)

    return make


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


def _subtree_owners(owner: dict[str, int]) -> dict[str, set[int]]:
    """Module name -> the stages owning some state at or below it ('' is the model)."""
    found: dict[str, set[int]] = {}
    for name, stage in owner.items():
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            found.setdefault(".".join(parts[:depth]), set()).add(stage)
    return found


class NamedStage:
    """Stage ``stage`` of ``model`` under ``plan``: holds only its own state, runs the
    model's forward from the inputs (and the previous stage's tensors) to its boundary."""

    def __init__(self, model: nn.Module, plan: StagePlan, stage: int, device: torch.device):
        self.model, self.plan, self.stage, self.device = model, plan, stage, device
        self.is_first, self.is_last = stage == 0, stage == plan.stages - 1
        own = {
            id(p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if plan.owner.get(n) == stage
        }
        owners = _subtree_owners(plan.owner)
        self._foreign: dict[str, nn.Module] = {}
        self._collect_foreign("", model, owners)
        for name, module in self._foreign.items():
            release_shared(module, own)  # a tied Parameter stays whole on this stage
            module.to("meta")
            module.forward = functools.partial(self._stub, name, module.forward)
        self._move_own(device)
        self._active, self._received, self._entered, self._checked = False, None, False, False
        self._split_names = plan.split_points
        container = model.get_submodule(plan.container) if plan.container else None
        if not self.is_first:
            block = container[plan.starts[stage]]
            block.register_forward_pre_hook(self._enter, with_kwargs=True)
        if not self.is_last:
            block = container[plan.starts[stage + 1]]
            block.register_forward_pre_hook(self._leave, with_kwargs=True)

    # -- what the stage holds ---------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under the model's names (a Parameter tied within the
        stage once, under its first name)."""
        seen: set[int] = set()
        named = []
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if self.plan.owner.get(name) == self.stage and id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
        return named

    def state(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's ``state_dict()``, under the same names."""
        full = self.model.state_dict()
        return {k: v for k, v in full.items() if self.plan.owner.get(k) == self.stage}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's entries from a full (canonical) state."""
        wanted = [k for k, s in self.plan.owner.items() if s == self.stage]
        missing = [k for k in wanted if k not in state]
        if missing:
            raise KeyError(f"the state has no {missing[0]!r}, which stage {self.stage} holds.")
        self.model.load_state_dict({k: state[k] for k in wanted}, strict=False)

    # -- running ----------------------------------------------------------------------

    def run(self, inputs: Any, received: list[torch.Tensor] | None = None) -> Any:
        """The model's forward on ``inputs`` as far as this stage goes: its output (the
        model's) on the last stage, else the tensors of the next stage's first block's
        arguments."""
        self._active, self._received, self._entered = self.is_first, received, self.is_first
        args, kwargs = as_arguments(inputs)
        try:
            out = self.model(*args, **kwargs)
        except _StageEnd as end:
            out = end.value
        else:
            if not self.is_last:
                raise PartitionError(
                    f"{type(self.model).__name__}'s forward never called split point "
                    f"{self._split_names[self.stage]!r}; name blocks that its forward calls."
                )
        finally:
            self._active, self._received = False, None
        if not self._entered:
            raise PartitionError(
                f"{type(self.model).__name__}'s forward never called split point "
                f"{self._split_names[self.stage - 1]!r}; name blocks that its forward calls."
            )
        if not self._checked and not self.is_first:
            self._checked = True
            if any(t.is_floating_point() and bool(t.isnan().any()) for t in tensors_in(out)):
                raise PartitionError(
                    f"stage {self.stage}'s first output holds NaN: the model uses something "
                    f"an earlier stage computes other than through the arguments of split "
                    f"point {self._split_names[self.stage - 1]!r} (or diverged at once); "
                    "choose split points between blocks that pass everything as arguments."
                )
        return out

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """At this stage's first block: its arguments become the previous stage's."""
        received = list(self._received or [])
        local = tensors_in((args, kwargs))
        if len(local) != len(received) or any(
            a.shape != b.shape for a, b in zip(local, received, strict=False)
        ):
            raise PartitionError(
                f"split point {self._split_names[self.stage - 1]!r} receives other tensors on "
                f"stage {self.stage} than the previous stage sent; its arguments must not "
                "depend on values only that stage holds."
            )
        queue = iter(received)
        self._active, self._entered = True, True
        return map_tensors((args, kwargs), lambda _: next(queue))

    def _leave(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """At the next stage's first block: stop, its arguments are this stage's output."""
        if self._active:
            raise _StageEnd(tensors_in((args, kwargs)))

    def _stub(self, name: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Another stage's module: shape-only before the split point, refused after it."""
        if self._active:
            raise PartitionError(
                f"{type(self.model).__name__}'s forward calls {name!r} on stage {self.stage} "
                f"after split point {self._here()!r}, but another stage holds it; choose "
                "split points so that each stage's modules run between its split points."
            )
        with torch.no_grad():
            out = forward(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
        return map_tensors(out, _placeholder(self.device))

    def _here(self) -> str:
        return "the start" if self.is_first else self._split_names[self.stage - 1]

    # -- setup --------------------------------------------------------------------------

    def _collect_foreign(self, name: str, module: nn.Module, owners: dict[str, set[int]]) -> None:
        """The largest modules whose state other stages own entirely."""
        held = owners.get(name, set())
        if not held:
            return  # no state: runs for real wherever it is called
        if self.stage not in held:
            self._foreign[name] = module
            return
        for child, sub in module.named_children():
            self._collect_foreign(f"{name}.{child}" if name else child, sub, owners)

    def _move_own(self, device: torch.device) -> None:
        """Move what this stage holds (the rest is on meta) to its device."""
        skip = tuple(f"{name}." for name in self._foreign)
        for name, module in self.model.named_modules():
            if name in self._foreign or name.startswith(skip):
                continue
            for param in module._parameters.values():
                if param is not None and param.device != device:
                    param.data = param.data.to(device)
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[key] = buffer.to(device)
