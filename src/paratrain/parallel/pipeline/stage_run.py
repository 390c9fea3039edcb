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

Virtual stages (interleaved 1F1B): the model is cut into stages x v pieces and a worker
holds v non-adjacent ones in one module tree; each chunk runs the model's forward from
its piece's first block to the next piece's, and the modules of the worker's other
pieces it meets before its first block run shape-only on meta twins, made once.

The hooks and the shape-only runs are ``untraced``: in a model compiled whole, or blocks
compiled in place (whose call wraps a stand-in's forward), dynamo traced them, ran their
meta tensors among its fake ones (Hugging Face's GPT-2 and Llama failed at stage 1's
first forward), warned of what it could not trace, and recompiled once per module a
stand-in stood for. Untraced, they are graph breaks, and the stage compiles its own code.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.parallel.inputs import as_arguments
from paratrain.parallel.layer_profile import map_output_tensors as map_tensors
from paratrain.parallel.pipeline.partition import PartitionError
from paratrain.parallel.pipeline.split_points import StagePlan
from paratrain.parallel.pipeline.ties import release_shared
from paratrain.parallel.pipeline.weight_units import param_owners
from paratrain.runtime.untraced import untraced


class _StageEnd(Exception):  # noqa: N818 - control flow, not an error
    """Raised at the next stage's first block; carries this stage's output."""

    def __init__(self, value: list[torch.Tensor]) -> None:
        super().__init__("stage boundary")
        self.value = value


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


REMEMBERED_SHAPES = 4096
"""Shape-only outputs kept at most (each a few hundred bytes of meta tensors)."""


def _is_cache(value: Any) -> bool:
    """A key-value cache (Hugging Face's ``Cache`` classes): storage per layer, which a
    layer's shape-only run fills with meta tensors no real layer reads."""
    return any(kind.__name__ == "Cache" for kind in type(value).__mro__)


def argument_signature(value: Any, *, caches: bool = True) -> Any:
    """A hashable description of ``value``'s structure and its tensors' shapes, dtypes and
    devices; None where it holds an object whose content could matter (anything but
    tensors, plain values, containers of them and, with ``caches``, key-value caches), so
    that a shape-only output is remembered only where the arguments say all it depends
    on, and skipping the run skips no side effect a real module could see."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return ("value", value)
    if isinstance(value, (tuple, list)):
        items = [argument_signature(item, caches=caches) for item in value]
        return None if None in items else (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = [(key, argument_signature(item, caches=caches)) for key, item in value.items()]
        if any(item is None or not isinstance(key, str) for key, item in items):
            return None
        return (type(value).__name__, tuple(items))
    if caches and _is_cache(value):
        return ("cache", type(value).__name__)
    return None


def _meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every parameter and buffer on meta (no data copied): the
    shape-only stand-in a chunk's forward calls for a module of another chunk."""
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(module, memo)


def _subtree_owners(owner: dict[str, int]) -> dict[str, set[int]]:
    """Module name -> the stages owning some state at or below it ('' is the model)."""
    found: dict[str, set[int]] = {}
    for name, stage in owner.items():
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            found.setdefault(".".join(parts[:depth]), set()).add(stage)
    return found


def _held_apart(
    model: nn.Module, plan: StagePlan, pieces: list[int]
) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, int]]]:
    """The largest modules whose state other workers hold entirely (by name), and, with
    several pieces here, the largest that one of them alone holds (by name, with that
    piece)."""
    owners, mine = _subtree_owners(plan.owner), set(pieces)
    foreign: dict[str, nn.Module] = {}
    switched: dict[str, tuple[nn.Module, int]] = {}

    def visit(name: str, module: nn.Module) -> None:
        held = owners.get(name, set())
        if not held:
            return  # no state: runs for real wherever it is called
        if held.isdisjoint(mine) and not _encloses(name, plan.container):
            foreign[name] = module
        elif len(mine) > 1 and len(held) == 1:
            switched[name] = (module, next(iter(held)))
        else:
            for child, sub in module.named_children():
                visit(f"{name}.{child}" if name else child, sub)

    visit("", model)
    return foreign, switched


def _encloses(name: str, container: str) -> bool:
    """Whether module ``name`` is the blocks' container or holds it (the model itself is
    ""): its forward walks the blocks, so it runs on every stage, even one that holds
    none of its state (a first piece of a Flatten alone, as the planner measures)."""
    return not name or name == container or container.startswith(f"{name}.")


def shape_twins(model: nn.Module, plan: StagePlan, pieces: list[int]) -> dict[str, nn.Module]:
    """A meta twin of each module one of ``pieces`` alone holds (none for one piece)."""
    _, switched = _held_apart(model, plan, pieces)
    return {name: _meta_twin(module) for name, (module, _) in switched.items()}


class NamedStage:
    """Pieces ``pieces`` of ``model`` under ``plan`` (one without virtual stages; with
    them, the worker's chunks, piece ``pieces[c]`` its chunk ``c``): holds only their
    state, runs the model's forward from the inputs (and the previous piece's tensors) to
    the active piece's boundary.

    Virtual stages: a worker holds several non-adjacent pieces in one module tree. Each
    module that one of its pieces alone holds (a block, the embeddings, the head) is given
    a shape-only twin on meta, made once; while another chunk runs, the forward meets it
    before that chunk's first block and calls the twin, as it calls another worker's
    module, so a chunk never computes another chunk's blocks."""

    def __init__(
        self,
        model: nn.Module,
        plan: StagePlan,
        pieces: list[int],
        device: torch.device,
        twins: dict[str, nn.Module] | None = None,
    ) -> None:
        """``twins``: the meta twins (``shape_twins``), where they had to be made before
        the model changed (a tensor split, whose modules hold its process group and
        whose collectives a shape-only run must not call); made here otherwise."""
        self.model, self.plan, self.pieces, self.device = model, plan, list(pieces), device
        own = {
            id(p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if plan.owner.get(n) in self.pieces
        }
        self._foreign, switched = _held_apart(model, plan, self.pieces)
        if twins is None:
            twins = {name: _meta_twin(module) for name, (module, _) in switched.items()}
        for name, module in self._foreign.items():
            release_shared(module, own)  # a tied Parameter stays whole on this stage
            module.to("meta")
            module.forward = untraced(functools.partial(self._stub, name, module.forward))
        for name, (module, piece) in switched.items():
            forward = functools.partial(self._chunk_of, name, piece, module.forward, twins[name])
            module.forward = forward
        self._move_own(device)
        self._piece = self.pieces[0]
        self._active, self._received, self._entered = False, None, False
        self._checked: set[int] = set()
        self._shapes: dict[tuple[str, Any], Any] = {}
        """Shape-only outputs by module and argument shapes (``_shape_only``)."""
        self._split_names = plan.split_points
        container = model.get_submodule(plan.container) if plan.container else None
        for piece in self.pieces:
            if piece > 0:
                block = container[plan.starts[piece]]
                enter = untraced(functools.partial(self._enter, piece))
                block.register_forward_pre_hook(enter, with_kwargs=True)
            if piece < plan.stages - 1:
                block = container[plan.starts[piece + 1]]
                leave = untraced(functools.partial(self._leave, piece))
                block.register_forward_pre_hook(leave, with_kwargs=True)

    # -- what the stage holds ---------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under the model's names (a Parameter tied within the
        stage once, under its first name)."""
        seen: set[int] = set()
        named = []
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if self.plan.owner.get(name) in self.pieces and id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
        return named

    def piece_owners(
        self, chunk: int
    ) -> tuple[dict[nn.Module, list[nn.Parameter]] | None, list[nn.Parameter]]:
        """The modules owning trainable parameters of piece ``pieces[chunk]`` directly,
        with those parameters (None where a parameter has two owners, as
        ``weight_units.param_owners`` says), and all its trainable parameters: what a
        zero-bubble W takes unit by unit."""
        piece = self.pieces[chunk]

        def held(name: str) -> bool:
            return self.plan.owner.get(name) == piece

        named = self.model.named_parameters(remove_duplicate=False)
        params = {id(p): p for n, p in named if held(n) and p.requires_grad}  # a tie once
        return param_owners(self.model, held), list(params.values())

    def state(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's ``state_dict()``, under the same names."""
        full = self.model.state_dict()
        return {k: v for k, v in full.items() if self.plan.owner.get(k) in self.pieces}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's entries from a full (canonical) state."""
        wanted = [k for k, s in self.plan.owner.items() if s in self.pieces]
        missing = [k for k in wanted if k not in state]
        if missing:
            raise KeyError(f"the state has no {missing[0]!r}, which {self._name()} holds.")
        self.model.load_state_dict({k: state[k] for k in wanted}, strict=False)

    # -- running ----------------------------------------------------------------------

    def run(self, inputs: Any, received: list[torch.Tensor] | None = None, chunk: int = 0) -> Any:
        """The model's forward on ``inputs`` as far as piece ``pieces[chunk]`` goes: its
        output (the model's) on the last piece, else the tensors of the next piece's first
        block's arguments."""
        self._piece = piece = self.pieces[chunk]
        first, last = piece == 0, piece == self.plan.stages - 1
        self._active, self._received, self._entered = first, received, first
        args, kwargs = as_arguments(inputs)
        try:
            out = self.model(*args, **kwargs)
        except _StageEnd as end:
            out = end.value
        else:
            if not last:
                raise PartitionError(
                    f"{type(self.model).__name__}'s forward never called split point "
                    f"{self._split_names[piece]!r}; name blocks that its forward calls."
                )
        finally:
            self._active, self._received = False, None
        if not self._entered:
            raise PartitionError(
                f"{type(self.model).__name__}'s forward never called split point "
                f"{self._split_names[piece - 1]!r}; name blocks that its forward calls."
            )
        if piece not in self._checked and not first:
            self._checked.add(piece)
            if any(t.is_floating_point() and bool(t.isnan().any()) for t in tensors_in(out)):
                raise PartitionError(
                    f"{self._name()}'s first output holds NaN: the model uses something "
                    f"an earlier stage computes other than through the arguments of split "
                    f"point {self._split_names[piece - 1]!r} (or diverged at once); "
                    "choose split points between blocks that pass everything as arguments."
                )
        return out

    def _enter(
        self, piece: int, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        """At ``piece``'s first block, when it runs: its arguments become the previous
        piece's output."""
        if piece != self._piece:
            return None  # another chunk's first block, met on the way: shape-only
        received = list(self._received or [])
        local = tensors_in((args, kwargs))
        if len(local) != len(received) or any(
            a.shape != b.shape for a, b in zip(local, received, strict=False)
        ):
            raise PartitionError(
                f"split point {self._split_names[piece - 1]!r} receives other tensors on "
                f"{self._name()} than the previous stage sent; its arguments must not "
                "depend on values only that stage holds."
            )
        queue = iter(received)
        self._active, self._entered = True, True
        return map_tensors((args, kwargs), lambda _: next(queue))

    def _leave(self, piece: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """At the block after ``piece``: stop, its arguments are the piece's output."""
        if self._active and piece == self._piece:
            raise _StageEnd(tensors_in((args, kwargs)))

    def _stub(self, name: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Another stage's module: shape-only before the split point, refused after it."""
        if self._active:
            raise PartitionError(
                f"{type(self.model).__name__}'s forward calls {name!r} on {self._name()} "
                f"after split point {self._here()!r}, but another stage holds it; choose "
                "split points so that each stage's modules run between its split points."
            )
        return self._shape_only(name, forward, args, kwargs)

    def _chunk_of(
        self,
        name: str,
        piece: int,
        forward: Callable[..., Any],
        twin: nn.Module,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """A module one of this worker's pieces alone holds: for real while that piece
        runs, on its meta twin before the running piece's first block (as another
        worker's module), refused after it."""
        if piece == self._piece and self._active:
            return forward(*args, **kwargs)
        if self._active:
            raise PartitionError(
                f"{type(self.model).__name__}'s forward calls {name!r} on {self._name()} "
                f"after split point {self._here()!r}, but another virtual stage holds it; "
                "choose split points so that each stage's modules run between its split "
                "points."
            )
        return self._shape_only(name, twin, args, kwargs)

    @untraced
    def _shape_only(self, name: str, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Placeholders of the shapes ``forward`` returns on meta copies of its arguments.
        Remembered by module and by the arguments' shapes (``argument_signature``): a meta run
        goes through torch's Python reference kernels, about a third of the real block's
        time (7 ms against 20 for a GPT-2 block of 4 x 128 x 256), every micro-batch."""
        signature = argument_signature((args, kwargs))
        key = None if signature is None else (name, signature)
        out = self._shapes.get(key) if key is not None else None
        if out is None:
            with torch.no_grad():
                out = forward(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
            if key is not None and argument_signature(out, caches=False) is not None:
                if len(self._shapes) >= REMEMBERED_SHAPES:
                    self._shapes.clear()  # shapes that keep changing (every sequence length)
                self._shapes[key] = out  # on meta: holds no memory
        return map_tensors(out, _placeholder(self.device))

    def _here(self) -> str:
        return "the start" if self._piece == 0 else self._split_names[self._piece - 1]

    def _name(self) -> str:
        """The running piece as messages name it."""
        kind = "virtual stage" if len(self.pieces) > 1 else "stage"
        return f"{kind} {self._piece}"

    # -- setup --------------------------------------------------------------------------

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
