"""ZeRO stages 1-3: data parallel with the model state sharded over the replicas.

Same contract as ``dp``: every rank receives the global batch, takes its contiguous share,
runs ``gradient_accumulation`` micro-batches and reduces gradients once per optimizer
step, so the result is the single-device engine's, to rounding. What differs is what a
worker keeps (fp32 Adam, P parameters, N workers, bytes per worker):

============  ==========  ==========  =========  ====================================
strategy      parameters  gradients   optimizer  communication per step (ring, /rank)
============  ==========  ==========  =========  ====================================
dp            4P          4P          8P         2(N-1)/N x 4P (all-reduce)
zero1         4P          4P          8P/N       reduce-scatter + all-gather = same
zero2         4P          4P/N        8P/N       reduce-scatter + all-gather = same
zero3         4P/N        4P/N        8P/N       1.5x (two all-gathers per micro-batch)
============  ==========  ==========  =========  ====================================

How: the trainable parameters are grouped into units (``shards.FlatUnit``), each
flattened into one padded buffer of which every rank owns an equal slice. The user's
optimizer factory is called with those slices (one ``nn.Parameter`` per unit), so each
rank updates only its slice; Adam and SGD are elementwise, so updating slices equals
updating the whole. After backward each unit's gradient is reduce-scattered
(``grads``); stages 1-2 then all-gather the updated slices back into the full
parameters; stage 3 never keeps full parameters, gathering each unit just before its
forward and backward (``gather``).

Units: stages 1-2 pack parameters, in reverse registration order (roughly the order
backward produces gradients), into buckets of ``bucket_mb`` (as DDP does), so backward
overlaps the reduce-scatter of finished buckets with the rest. Stage 3's units are the
model's repeated blocks (each ``GPT2Block``), or the layers of an ``nn.Sequential``, or
what ``units=`` names, plus the root unit of the parameters outside them (``units``);
modules sharing a parameter (tied weights) are one unit.
A tied parameter is one Parameter, so it sits in one unit under its canonical name (the
one ``named_parameters()`` gives) at every stage, and gets its summed gradient as on one
device.

The optimizer works on flat slices, not the model's parameters. Parameter groups (no
weight decay on biases, by name or not) are learned from the factory first and kept
apart: zero1/2 buckets hold one group each, a zero3 unit whose parameters span groups is
handed over as per-parameter pieces, and the optimizer is rebuilt over the slices with
the user's groups in order (``groups``). An optimizer not known to be elementwise is
refused (``optim``) unless the user passes ``elementwise_optimizer=True``.
Frozen parameters (``requires_grad=False``) and buffers stay replicated as in ``dp``, and
``broadcast_buffers``, ``sync_batchnorm`` and each replica's own random stream work as
there (``replicas``).

Unused parameters: a parameter that no replica's backward reached in a step is skipped by
the optimizer, as torch skips one whose ``.grad`` is None (``grads`` agrees on which,
``unused`` holds such a parameter's unit as per-parameter pieces); one used on some
replicas only gets the global-batch mean, zeros from the others. Stage 3 gathers its
units in module order, so a unit that some replicas run and others skip in the same step
(a branch the data chooses) is gathered by all of them alike (``gather``); a parameter
some replicas leave unused inside a unit all of them run is found before backward by
walking the autograd graph (``reach``), so that unit's reduction does not wait for a
gradient that will not come.

Mixed precision (``precision=``) works as in ``dp``: forward under autocast, fp32
parameters, gradients and optimizer state; under fp16 each rank checks its own gradient
slices for inf/NaN and the flag is summed over the replicas (one tiny all-reduce), so all
skip or all step. Under autocast, stage 3 also holds the low-precision copies autocast
caches of each weight until the forward ends (2 bytes per parameter under bf16/fp16).
The memory ledger (``memory_per_device``) books the state ``model_state_bytes`` reports
and the activations autograd saves, leaving out stage 3's gathered parameters.

Split layers (zero1/2's ``tensor``, ``tp_plan``): the workers form ``replicas x tensor``
as under ``dp`` (``replicas``), each tensor rank's replicas sharding the state of its
slices and of the replicated tensors; zero3 does not split layers.

``recompute=True`` checkpoints the layer list by segment as in ``dp`` (``recompute``):
only each segment's input is kept for backward. Stages 1-2 need nothing more; stage 3
runs backward inside ``ParameterGatherer.backward_pass`` so that a segment's recompute
does not free the unit backward is about to use (see ``gather``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.fused_optim import with_fused_kernel
from paratrain.parallel.grad_buckets import MiB, plan_buckets
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.recompute import recomputing_forward
from paratrain.parallel.replicas import ReplicaShare
from paratrain.parallel.single import canonical_state
from paratrain.parallel.strategy import (
    Engine,
    OptimizerFactory,
    require_process_group,
)
from paratrain.parallel.zero.checkpoint import ZeroCheckpointState
from paratrain.parallel.zero.gather import ParameterGatherer
from paratrain.parallel.zero.grads import ShardedGradients
from paratrain.parallel.zero.groups import learn_groups
from paratrain.parallel.zero.optim import check_sharded_optimizer
from paratrain.parallel.zero.reduce_scatter import ReduceScatterShards
from paratrain.parallel.zero.shard_held import ShardCopiesMixin
from paratrain.parallel.zero.shards import FlatUnit, trainable
from paratrain.parallel.zero.units import UnitSpec, check_units, unit_modules
from paratrain.parallel.zero.unused import ShardPieces, make_pieces
from paratrain.runtime import comm
from paratrain.runtime.memory import model_state_bytes


class ZeroEngine(ReplicaShare, ZeroCheckpointState, Engine):
    """What the three stages share: flat units, sharded optimizer, reduce-scatter."""

    stage: int

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: Layout,
        group: ProcessGroup | None = None,
        recompute: bool = False,
        elementwise_optimizer: bool = False,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
        tensor: int | None = None,
        tp_plan: dict[str, str] | str | None = None,
        **shared: Any,
    ) -> None:
        """The stages' options (see the stage classes); ``shared``: every engine's
        (``EngineSettings``)."""
        super().__init__(model, layout=layout, **shared)
        if self.stage == 3 and tensor not in (None, 1):
            raise ValueError(
                "zero3 does not split layers over a tensor group; use zero1 or zero2 with "
                "tensor, or zero3 without it."
            )
        self._parameters = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        self.recompute = recompute
        self._check_layout(model)
        if recompute:  # before any collective: it refuses models recompute cannot segment
            recomputing_forward(model)
        require_process_group(self.name)
        replica = self._become_replica(
            model,
            group=group,
            broadcast_buffers=broadcast_buffers,
            sync_batchnorm=sync_batchnorm,
            tp_plan=tp_plan,
            recompute=recompute,
        )
        self.model = replica.model
        self._segments = replica.forward if recompute else None
        optimizer = self.settings.optimizer
        # The user's groups first: zero1/2 lay their buckets out so that none mixes groups.
        self.param_groups = learn_groups(
            optimizer, list(self.model.named_parameters()), strategy=self.name
        )
        self.units, self.gatherer = self._build_units()
        self.grads = ShardedGradients(
            self.units,
            order=self._reduce_order(),
            # zero3 interleaves them with gathers, differently where replicas used different
            # parameters: a group of their own keeps both orders matched (see ``gather``)
            group=comm.second_group(self.group) if self.stage == 3 else self.group,
            keep_full=self.stage == 1,
            on_unit_done=self.gatherer.release if self.gatherer is not None else None,
        )
        if self.gatherer is not None:
            self.gatherer.on_skipped = self.grads.skipped
        self.optimizer, self.pieces = self._build_optimizer(optimizer, elementwise_optimizer)
        for unit in self.units:  # stage 3: a gathered unit's storage is a parameter, not saved data
            unit.on_gathered = lambda full: self.memory.activations.exclude(full)
            unit.on_releasing = lambda full: self.memory.activations.include(full)
        self.memory.watch(
            [*self.model.parameters(), *(unit.shard for unit in self.units)],
            model_state=self.model_state_bytes,
        )
        reducer = ReduceScatterShards(
            grads=self.grads,
            units=self.units,
            pieces=self.pieces,
            gatherer=self.gatherer,
            group=self.group,
            tensor_split=self.tensor_split,
            mesh=self.mesh,
            device=self._device,
            after_step=self._after_step,
        )
        self._plug_step(reducer, self._model_forward)

    def _check_layout(self, model: nn.Module) -> None:
        """Refuse a model the stage cannot shard, before any collective."""

    def _build_optimizer(
        self, factory: OptimizerFactory, elementwise_optimizer: bool
    ) -> tuple[torch.optim.Optimizer, ShardPieces]:
        """The user's optimizer over this rank's slices, each in its parameters' group; a
        unit whose parameters are in several groups is handed over as per-parameter
        pieces (``unused``), each in its parameter's group (see ``groups``)."""
        group_of = self.param_groups.index()
        tensors: list[list[nn.Parameter]] = [[] for _ in self.param_groups.names]
        pieces = {}
        for index, unit in enumerate(self.units):
            owners = {group_of[name] for name in unit.names}
            if len(owners) == 1:
                tensors[owners.pop()].append(unit.shard)
                continue
            pieces[index] = make_pieces(unit)
            for param_index, _start, _end, piece in pieces[index]:
                tensors[group_of[unit.names[param_index]]].append(piece)
        # the fused CPU kernel where the user left the choice to torch, as dp's engine
        # (``fused_optim``): an Adam step over the mlp's 1.2 M-element slice took 6.8 ms
        # looped, where dp's fused step over all 2.4 M elements took 3.9 ms
        optimizer = with_fused_kernel(self.param_groups.build(factory, tensors))
        check_sharded_optimizer(
            optimizer,
            [tensor for group in tensors for tensor in group],
            strategy=self.name,
            elementwise_optimizer=elementwise_optimizer,
        )
        return optimizer, ShardPieces(self.units, optimizer, pieces)

    def _model_forward(self, inputs: Any) -> Any:
        """The model's forward, by recomputed segments when ``recompute`` is on."""
        if self._segments is None:
            return call_model(self.model, inputs)
        if self.gatherer is None:
            return call_model(self._segments, inputs)
        self.gatherer.begin_forward()  # the segments bypass model(...) and its hooks
        output = call_model(self._segments, inputs)
        self.gatherer.end_forward()
        return output

    def _build_units(self) -> tuple[list[FlatUnit], ParameterGatherer | None]:
        raise NotImplementedError

    def _reduce_order(self) -> list[int]:
        return list(range(len(self.units)))

    def _unit(self, label: str, named: list[tuple[str, nn.Parameter]]) -> FlatUnit:
        return FlatUnit(
            label,
            named,
            rank=self._replica_rank,
            world=self._replicas,
            own_shard_storage=self.stage == 3,
        )

    def _after_step(self) -> None:
        """Stages 1-2: bring every rank's updated slice back into the full parameters."""
        handles = []
        for unit in self.units:
            mine = unit.shard.detach().clone()  # the input must not alias the output
            handles.append(
                (comm.all_gather_flat(unit.full, mine, group=self.group, async_op=True), mine)
            )
        for handle, _mine in handles:
            comm.wait(handle, "parameter all_gather")

    def _after_eval(self) -> None:
        if self.gatherer is not None:
            self.gatherer.release_all()

    # -- state --------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """What this worker holds, counted from the live tensors (each storage once).

        Stages 1-2: the full parameters (the optimizer's slices are views into them);
        stage 1 the full gradient buffers, stage 2 only the reduced slices. Stage 3,
        between steps, holds only its slices: every unit's full buffer is freed (during a
        step one unit at a time is materialised, plus the root). Call it after a
        ``train_step``: before the first one there are no gradients or optimizer state.
        """
        tensors = [*self.model.parameters(), *(unit.shard for unit in self.units)]
        return model_state_bytes(tensors, self.optimizer)

    @property
    def parameter_bytes(self) -> int:
        return self.model_state_bytes()["parameters"]

    def writes_shard(self) -> bool:
        """The first replica; with split layers, each tensor rank's (its slices are joined
        over the tensor group before the first of them writes)."""
        if self.tensor_split is not None:
            return self._replica_rank == 0
        return comm.rank() == 0

    def local_state(self) -> dict[str, torch.Tensor]:
        """This worker's canonical model state, its split layers as slices."""
        return canonical_state(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's state (every worker calls it)."""
        return self._whole(self.local_state())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = self._local(state)
        expected = set(self.model.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise KeyError(
                f"the state does not match the model (missing {missing[:3]}, unexpected "
                f"{extra[:3]}); pass a full canonical state such as state_dict() returns."
            )
        self._load_units(state.__getitem__)

    def _load_units(self, fetch) -> None:
        """Set every unit's slice, and the replicated tensors, from canonical tensors."""
        in_units = set()
        for unit in self.units:
            unit.load_full(fetch)
            in_units.update(unit.names)
        aliases = self.tied_names()  # a tied tensor is set once, under its canonical name
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                if name not in in_units and name not in aliases:
                    tensor.copy_(fetch(name))


class _ReplicatedParameters(ZeroEngine):
    """Stages 1-2: the full parameters stay on every rank; units are ``bucket_mb`` buckets.
    With ``tensor``, the full parameters of this worker's slices."""

    def run_metrics(self) -> dict[str, Any] | None:
        return self.split_metrics(list(self.model.parameters()), self._parameters) or None

    def __init__(self, model: nn.Module, *, bucket_mb: float = 25.0, **options: Any) -> None:
        """``bucket_mb`` as above; every other option as ``ZeroEngine`` takes it. The size
        is kept before the shared constructor builds the buckets from it."""
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, not {bucket_mb!r}.")
        self._bucket_bytes = int(bucket_mb * MiB)
        super().__init__(model, **options)

    def _build_units(self) -> tuple[list[FlatUnit], None]:
        """Buckets of one dtype, device and parameter group each, in reverse registration
        order; with several groups, each kind's buckets are launched in the order backward
        completes them (by the last of their parameters to get its gradient)."""
        ordered = list(reversed(trainable(list(self.model.named_parameters()))))
        position = {name: i for i, (name, _) in enumerate(ordered)}
        group_of = self.param_groups.index()
        planned: list[list[tuple[str, nn.Parameter]]] = []
        for kind in dict.fromkeys((p.dtype, p.device) for _, p in ordered):
            buckets = []
            for group in range(len(self.param_groups.names)):
                same = [
                    (n, p)
                    for n, p in ordered
                    if (p.dtype, p.device) == kind and group_of[n] == group
                ]
                plan = plan_buckets(
                    [p.numel() * p.element_size() for _, p in same],
                    bucket_bytes=self._bucket_bytes,
                    first_bucket_bytes=self._bucket_bytes,
                )
                buckets += [[same[i] for i in indices] for indices in plan]
            planned += sorted(buckets, key=lambda b: max(position[n] for n, _ in b))
        return [self._unit(f"bucket{i}", named) for i, named in enumerate(planned)], None


class Zero1Engine(_ReplicatedParameters):
    """ZeRO stage 1: optimizer state sharded; parameters and gradients whole on every rank.

    Options: ``bucket_mb`` (size of the flat units reduce-scattered during backward,
    default 25), ``group`` (the replicas' process group; the whole job by default),
    ``recompute`` (keep only each layer segment's input for backward and recompute the
    rest, as in ``dp``), ``elementwise_optimizer`` (the user vouches that an optimizer
    class paratrain does not know updates each element alone; see ``optim``),
    ``broadcast_buffers`` and ``sync_batchnorm`` (as ``dp``), ``tensor`` and ``tp_plan``
    (split layers over tensor groups, as ``dp``).
    """

    stage = 1


class Zero2Engine(ShardCopiesMixin, _ReplicatedParameters):
    """ZeRO stage 2: optimizer state and gradients sharded; parameters whole on every rank.

    Options as ``zero1``, and ``shard_copies`` (each worker also keeps its ring
    neighbour's optimizer slice, so an elastic run goes on after a death from memory; see
    ``shard_copies``).
    """

    stage = 2

    def __init__(self, model: nn.Module, *, shard_copies: bool = False, **options: Any) -> None:
        super().__init__(model, **options)
        self.shard_copies = self._copies(model) if shard_copies else None
        if self.shard_copies is not None:  # a death in the first step finds copies too
            self.shard_copies.exchange(self.steps_taken, pieces=False)


class Zero3Engine(ZeroEngine):
    """ZeRO stage 3: parameters, gradients and optimizer state all sharded.

    Options: ``group``, ``recompute``, ``elementwise_optimizer``, ``broadcast_buffers``,
    ``sync_batchnorm`` (as ``zero1``), ``units`` (which modules are gathered one at a
    time: by default the model's repeated blocks, or the layers of an ``nn.Sequential``;
    names, fnmatch patterns over names or a module class, see ``units``). ``recompute``
    requires the model to be a layer list.
    """

    stage = 3

    def __init__(self, model: nn.Module, *, units: UnitSpec | None = None, **options: Any) -> None:
        """``units`` as above; every other option as ``ZeroEngine`` takes it. The spec is
        kept before the shared constructor builds the units from it."""
        self._unit_spec = units
        super().__init__(model, **options)

    def _check_layout(self, model: nn.Module) -> None:
        check_units(model, self._unit_spec, self.recompute)

    def _build_units(self) -> tuple[list[FlatUnit], ParameterGatherer]:
        modules = unit_modules(self.model, self._unit_spec)
        named = dict(self.model.named_parameters())
        by_id = {id(p): n for n, p in named.items()}
        units = []
        for label, children in modules:
            held = dict.fromkeys(p for child in children for p in child.parameters())
            params = [(by_id[id(p)], p) for p in held if p.requires_grad]
            units.append(self._unit(label, params))
        in_units = {id(p) for unit in units for p in unit.params}
        root_params = [(n, p) for n, p in trainable(list(named.items())) if id(p) not in in_units]
        root = self._unit("<root>", root_params) if root_params else None
        gatherer = ParameterGatherer(
            self.model, [m for _, m in modules], units, root, group=self.group
        )
        all_units = [*units, *([root] if root is not None else [])]
        for unit in all_units:
            unit.release()
        return all_units, gatherer

    def _reduce_order(self) -> list[int]:
        """Backward finishes the last layer first; the root (last in the list) goes last."""
        layers = len(self.units) - (1 if self.gatherer.root is not None else 0)
        return [*reversed(range(layers)), *range(layers, len(self.units))]

    def _after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit when it needs it."""

    def local_state(self) -> dict[str, torch.Tensor]:
        """Gathers one unit at a time (every rank takes part) into full CPU tensors."""
        gathered: dict[str, torch.Tensor] = {}
        for unit in self.units:
            unit.gather(self.group)
            for name, param in zip(unit.names, unit.params, strict=True):
                gathered[name] = param.detach().to("cpu", copy=True)
            unit.release()
        aliases = self.tied_names()
        state = {}
        for name, value in self.model.state_dict().items():
            canonical = aliases.get(name, name)
            if canonical in gathered:
                state[name] = gathered[canonical].clone() if name in aliases else gathered[name]
            else:
                state[name] = value.detach().to("cpu", copy=True)
        return state
