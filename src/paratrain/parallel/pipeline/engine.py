"""Pipeline model parallel: contiguous stages of the layer list, fed micro-batches.

A model that is not a layer list is cut at named blocks instead (``split_points``,
``stage_run``): each stage holds the whole module tree with other stages' state on meta and
runs the model's own forward; everything below is the same for both.

Each worker keeps only its stage's layers (the rest are moved to the meta device, which
frees their memory) and builds the optimizer over those parameters alone. With
``virtual_stages = v`` a worker holds ``v`` non-adjacent pieces of the layer list instead
(``chunks``), run by interleaved 1F1B (a model cut at named blocks: v non-adjacent
pieces of its blocks in one module tree, ``stage_run``). A schedule from ``schedules``
(GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2) tells each stage the order of its passes;
activations and their gradients move between neighbours by point-to-point messages
(``p2p``). With more workers than stages, each stage is replicated over a data-parallel
group (``mesh``) whose members average that stage's gradients with the same bucketed
all-reduce the dp engine uses.

Equal to the single-device engine: micro-batch losses are scaled by 1/(micro-batches x
accumulation rounds x replicas), so the summed gradients are those of the global-batch mean.
A Parameter tied across stages (an output head sharing the embedding) has a copy on each
stage that uses it; ``ties`` keeps the copies equal by summing their gradients.

Mixed precision: each stage runs its layers under the ``Precision``'s autocast, so the
activations and gradients passed between stages travel in bf16/fp16. Under fp16 the loss
scale multiplies the last stage's loss; each stage holds different gradients, so whether
to skip an overflowing step is voted on by the whole job (one all-reduce of a flag).
The memory ledger counts the stage's saved activations and, as communication buffers,
the point-to-point buffers posted and not yet flushed.

Every worker draws from a random stream of its own (``replica_rng``); a stage draws its
micro-batches' dropout masks in micro-batch order whatever the schedule. ``recompute``
refuses models with BatchNorm, whose running statistics the recompute would update twice.
Replicas of a stage update their running statistics from their own micro-batches; the
first replica's reach the others before each step and evaluation (``buffer_sync``), as
DDP's default does, so evaluation and the saved state agree.

Split layers (``tensor``, ``tp_plan``): the workers form ``replicas x stages x tensor``
(``runtime/mesh``, tensor innermost); a stage's tensor group splits the planned layers of
that stage (``parallel/tensor``; the plan is checked on the whole model so that the stages
agree) and draws one random stream. Each member exchanges its activations and their
gradients with the member of the same tensor rank in the neighbouring stages: replicated
values arrive whole, and a colwise layer's slice at the end of a stage reaches the
rowwise layer that takes it. A model cut at named split points splits the planned layers
of the modules each stage alone holds; what crosses a split point (a block's arguments)
is whole on every member.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.parallel.batching import (
    batch_size,
    check_divisible,
    split_micro,
    take_share,
    to_device,
)
from paratrain.parallel.buffer_sync import BufferBroadcast
from paratrain.parallel.clipping import clip_distributed
from paratrain.parallel.fused_optim import with_fused_kernel
from paratrain.parallel.grad_buckets import BucketedGradientReducer
from paratrain.parallel.inputs import as_arguments
from paratrain.parallel.layer_profile import param_profiles, profile_layers
from paratrain.parallel.layers import LayerPieces, is_layer_list, layer_list
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.metric_tally import Metric, Tally
from paratrain.parallel.model_loss_items import part_inputs, with_num_items
from paratrain.parallel.pipeline.chunks import (
    Chunk,
    build_chunks,
    chunk_links,
    held_pieces,
)
from paratrain.parallel.pipeline.options import STAGES, micro_batches_per_replica
from paratrain.parallel.pipeline.partition import (
    check_stages,
    partition,
    stage_bounds,
    validate_balance,
)
from paratrain.parallel.pipeline.runner import ScheduleRunner
from paratrain.parallel.pipeline.schedules import build_schedule, splits_backward
from paratrain.parallel.pipeline.split_backward import (
    ChunkOwners,
    LayerTape,
    graph_leaves,
)
from paratrain.parallel.pipeline.split_backward_limits import keep_compiled_graphs_for_w
from paratrain.parallel.pipeline.split_points import (
    StagePlan,
    layer_list_balance,
    plan_stages,
    refuse_for_split_points,
    refuse_splits_across_stages,
)
from paratrain.parallel.pipeline.stage_run import NamedStage, shape_twins
from paratrain.parallel.pipeline.step_passes import (
    StageParts,
    StepPasses,
    pass_loss_back,
)
from paratrain.parallel.pipeline.ties import CrossStageTies, layer_list_stages, release_shared
from paratrain.parallel.pipeline.weight_units import graph_tensors
from paratrain.parallel.recompute import refuse_batchnorm
from paratrain.parallel.replica_builder import replicate_stage
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.strategy import (
    Engine,
    RecordsTimeline,
    StepStats,
    optimizer_from_factory,
    require_process_group,
)
from paratrain.parallel.tensor import vocab_loss
from paratrain.parallel.tensor.compose import SplitsLayers
from paratrain.parallel.tensor.split import split_model
from paratrain.parallel.ties import tied_names
from paratrain.runtime import comm
from paratrain.runtime.memory import model_state_bytes
from paratrain.runtime.mesh import build_mesh


def choose_balance(
    layers: nn.Sequential,
    stages: int,
    *,
    balance: list[int] | None,
    balance_by: str,
    sample_input: Any = None,
) -> list[int]:
    """The layer count of each stage: given, or balanced by the chosen cost.

    Measured costs differ from worker to worker, so rank 0 decides and broadcasts.
    """
    check_stages(len(layers), stages)
    if balance is not None:
        return validate_balance(balance, layers=len(layers), stages=stages)
    decided: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        if balance_by in ("time", "memory"):
            if sample_input is None:
                raise ValueError(
                    f"balance_by={balance_by!r} measures the layers on a sample: pass "
                    "sample_input=<one micro-batch of inputs>, or use balance_by='params'."
                )
            profiles = profile_layers(list(layers), sample_input)
        else:
            profiles = param_profiles(list(layers))
        decided[0] = partition(balance_by, profiles, stages)
    if dist.is_initialized():
        dist.broadcast_object_list(decided, src=0)
    return list(decided[0])


class PipelineEngine(RecordsTimeline, SplitsLayers, Engine):
    """Stages of the layer list on consecutive workers, scheduled GPipe or 1F1B.

    Options: ``stages`` (pipeline depth; workers / stages replicas of each stage),
    ``micro_batches`` per replica and step (default 2 x stages), ``schedule`` ("1f1b" or
    "gpipe"), ``balance`` (explicit layers per stage) or ``balance_by`` ("params", "time",
    "memory"; the last two need ``sample_input``; with virtual stages one entry per piece),
    ``virtual_stages`` (chunks per worker, of a layer list or at named blocks),
    ``split_points`` (block names where stages start, for a model that is not a layer list;
    stages x virtual_stages - 1 of them), ``recompute`` (keep only each stage's
    input per micro-batch and recompute the rest in backward), ``bucket_mb`` (gradient
    all-reduce buckets across replicas), ``tensor`` (workers each stage's split layers are
    spread over; 1 by default) and ``tp_plan`` (``setup`` only; see ``tensor/plan``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: Layout,
        stages: int = STAGES.default,
        micro_batches: int | None = None,
        schedule: str = "1f1b",
        balance: list[int] | None = None,
        balance_by: str = "params",
        sample_input: Any = None,
        recompute: bool = False,
        bucket_mb: float = 25.0,
        split_points: list[str] | None = None,
        tensor: int | None = None,
        virtual_stages: int | None = None,
        tp_plan: dict[str, str] | str | None = None,
        **shared: Any,
    ) -> None:
        """The pipeline's options as above; ``shared``: every engine's
        (``EngineSettings``). The steps, in order: refusals (before any collective), the
        schedule, the mesh, this stage's cut, its replicas, its optimizer, its link."""
        super().__init__(model, layout=layout, **shared)
        require_process_group(self.name)
        stages, chunks = layout.stages, layout.virtual_stages
        self._parameters = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        pieces = stages * chunks
        balance = self._check_cut(model, pieces, balance, balance_by, split_points, recompute)
        self.micro_batches = micro_batches_per_replica(stages, micro_batches)
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, not {self.micro_batches}.")
        self.schedule_name = schedule
        self.actions = build_schedule(schedule, stages, self.micro_batches, chunks)
        self.split_backward = splits_backward(self.actions)  # B and W apart (zero bubble)
        if self.split_backward:
            keep_compiled_graphs_for_w()  # before the stage's first forward compiles
        self.mesh = build_mesh(layout)
        self._tied_names = tied_names(model)  # of the whole model, before it is cut
        self.slice: LayerPieces | None = None
        self.named: NamedStage | None = None
        self._chunk_modules: list[nn.Module] = []
        if is_layer_list(model):
            self._cut_layer_list(model, balance, balance_by, sample_input, tp_plan)
        else:
            self._cut_named(model, stages, split_points, tp_plan)
        # the last stage's vocab-split lm head keeps its logits split where the loss is ours
        self._speaks = comm.rank() == self.mesh.rank_of(self.mesh.stages - 1, 0, 0)
        sharded = vocab_loss.sharded_loss(self.loss_fn, self.module, speaks=self._speaks)
        self.loss_fn = sharded or self.loss_fn
        self._params = [p for _, p in self.named_local_parameters()]
        self.ties.attach(dict(self._full_named_parameters()))
        self.flush = self._step_ends_together()
        if not self.flush:  # ZB-H1 then lets one step's last W passes meet the next step
            self.actions = build_schedule(schedule, stages, self.micro_batches, chunks, flush=False)
        self.recompute = recompute
        self._start_replicas(bucket_mb)
        self.optimizer = self._stage_optimizer()
        links = chunk_links(self.mesh, self._device, chunks, window=stages)
        self.chunks: list[Chunk] = build_chunks(
            self._chunk_modules or [self.module], links, self.mesh
        )
        self.link = links[-1]  # the last chunk's: the step's loss travels along it
        self.events: list[dict[str, Any]] = []
        self.runner = ScheduleRunner(
            self.actions, self.mesh.stage, links=links, memory=self.memory, events=self.events
        )
        self.stage_parts = self._stage_parts()
        self.memory.watch(
            self._params,
            model_state=self.model_state_bytes,
            communication=lambda: sum(link.held_bytes() for link in links),
        )

    def _step_ends_together(self) -> bool:
        """Whether the stages run the lists of steps that end together (a flush): the
        global norm of clipping, fp16's vote on a step to skip and the sum of a tie's
        gradients across stages each make every stage wait for every other's W passes.
        Without one, nothing but each stage's own order joins two steps, and a later stage
        may run its last W passes while the first already runs the next step's forwards
        (the lists of ``schedules.zb_h1`` with ``flush=False``, which hold more on later
        stages). A stage split over a tensor group keeps the flushed lists too: the
        planner's count of such a stage's saved bytes per micro-batch falls short (Hugging
        Face Llama's last stage at ``tensor=2``: 52 of 65 KB live), and one micro-batch more
        held there took its predicted peak 5% under the live one. The same answer on every
        worker, since every worker must run the same lists."""
        return (
            self.max_grad_norm is not None
            or self.precision.scales_loss
            or self.ties.spans_stages
            or self.degrees.tensor > 1
        )

    def _stage_parts(self) -> StageParts:
        """What a step's passes use of this stage (``step_passes``), once it is built."""
        return StageParts(
            chunks=self.chunks,
            loss_link=self.link,
            mesh=self.mesh,
            device=self._device,
            memory=self.memory,
            precision=self.precision,
            runner=self.runner,
            run_stage=self._run_stage,
            owners_of=self._owners,
            micro_batches=self.micro_batches,
            split_backward=self.split_backward,
            recompute=self.recompute,
            needs_inputs=self._needs_inputs,
        )

    @staticmethod
    def _check_cut(
        model: nn.Module,
        stages: int,
        balance: list[int] | None,
        balance_by: str,
        split_points: list[str] | None,
        recompute: bool,
    ) -> list[int] | None:
        """Refuse, before any collective (alike on every worker), a cut the model does not
        allow; returns the balance (split points on a layer list become one)."""
        sequential = is_layer_list(model)
        if sequential and split_points is not None:
            if balance is not None:
                raise ValueError("give balance or split_points, not both.")
            balance = layer_list_balance(model, split_points, stages)
        if not sequential:
            refuse_for_split_points(balance=balance, balance_by=balance_by, recompute=recompute)
        elif recompute:
            refuse_batchnorm(layer_list(model)[0])
        return balance

    def _cut_named(
        self,
        model: nn.Module,
        stages: int,
        split_points: list[str] | None,
        tp_plan: dict[str, str] | str | None,
    ) -> None:
        """A model that is no layer list: this stage runs the model's own forward with the
        other stages' modules on meta (``stage_run``), its planned layers split first.
        With virtual stages the model is cut into stages x v pieces and this stage holds
        pieces ``held_pieces`` (as a layer list's), each a chunk run to its boundary."""
        chunks = self.degrees.virtual_stages
        plan = plan_stages(model, stages * chunks, split_points, virtual_stages=chunks)
        pieces = held_pieces(self.mesh.stage, stages, chunks)
        self.balance, self.split_points = plan.balance, plan.split_points
        # ties read before the split: a tie split by vocabulary is two slices afterwards;
        # piece j lives on stage j % stages
        named = [
            (n, p, plan.owner[n] % stages)
            for n, p in model.named_parameters(remove_duplicate=False)
        ]
        twins = shape_twins(model, plan, pieces)  # of the modules as they are, unsplit
        if self.mesh.tensor > 1:
            self._split_named(model, plan, pieces, tp_plan)
        self.ties = CrossStageTies(named, self.mesh)
        self.named = NamedStage(model, plan, pieces, self._device, twins)
        self.module = model  # the whole model; other stages' modules are on meta
        if chunks > 1:  # each chunk runs the model's forward to its own boundary
            self._chunk_modules = [model] * chunks

    def _split_named(
        self,
        model: nn.Module,
        plan: StagePlan,
        pieces: list[int],
        tp_plan: dict[str, str] | str | None,
    ) -> None:
        """Split the planned layers inside the modules this stage's pieces alone hold over
        its tensor group, from its first member's values (a split keeps every state name,
        so ``plan.owner`` still names them). Between stages a block's arguments travel,
        which are whole on every member (a rowwise layer's output is summed), so each
        member exchanges them with the same tensor rank of the neighbouring stages
        unchanged."""
        owned = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        state = {id(t): t for n, t in owned if plan.owner.get(n) in pieces}
        comm.broadcast_tensors(list(state.values()), src=0, group=self.mesh.tensor_group)
        only = set().union(*(plan.modules_of(piece) for piece in pieces))
        self.tensor_split = split_model(model, self.mesh, tp_plan=tp_plan, only=only)
        refuse_splits_across_stages(plan, self.tensor_split.whole_plan)  # alike on every rank

    def _start_replicas(self, bucket_mb: float) -> None:
        """The stage made equal over its replicas (``replica_builder.replicate_stage``),
        tied copies made equal, then each worker's own random stream."""
        replicas = replicate_stage(
            self._params, self._local_buffers(), mesh=self.mesh, bucket_mb=bucket_mb
        )
        self.reducer: BucketedGradientReducer | None = replicas.reducer
        self.buffer_sync: BufferBroadcast | None = replicas.buffer_sync
        self.ties.broadcast_values()  # copies of a tied Parameter start equal
        separate_streams()
        if self.tensor_split is not None:  # a tensor group computes its activations alike
            self.tensor_split.share_stream(self._device)

    def _stage_optimizer(self) -> torch.optim.Optimizer | None:
        """The user's optimizer over this stage's trainable parameters; None for a stage
        of parameter-free layers only (an activation, a reshape). torch's fused CPU kernel
        where the user left the choice to torch (see ``fused_optim``)."""
        trainable = [(n, p) for n, p in self.named_local_parameters() if p.requires_grad]
        if not trainable:
            return None
        return with_fused_kernel(optimizer_from_factory(self.settings.optimizer, trainable))

    def _cut_layer_list(self, model, balance, balance_by, sample_input, tp_plan) -> None:
        """Keep this stage's slice of the layer list, its planned layers split over the
        tensor group; the other layers go to meta."""
        layers, prefix = layer_list(model)
        stages, chunks = self.mesh.stages, self.degrees.virtual_stages
        self.balance = choose_balance(
            layers,
            stages * chunks,
            balance=balance,
            balance_by=balance_by,
            sample_input=sample_input,
        )
        self.split_points = None
        bounds = stage_bounds(self.balance)
        pieces = [range(*bounds[j]) for j in held_pieces(self.mesh.stage, stages, chunks)]
        held = [index for piece in pieces for index in piece]
        # ties read before the split: a tie split by vocabulary is two slices afterwards
        owners = layer_list_stages(layers, bounds, prefix, stages=stages)
        if self.mesh.tensor > 1:  # every chunk's planned layers, over the tensor group
            mine = [layers[i] for i in held]
            # the members cut their slices from one stage, their first member's
            state = [t for layer in mine for t in (*layer.parameters(), *layer.buffers())]
            comm.broadcast_tensors(state, src=0, group=self.mesh.tensor_group)
            only = {f"{prefix}{i}" for i in held}
            self.tensor_split = split_model(model, self.mesh, tp_plan=tp_plan, only=only)
            layers, prefix = layer_list(model)  # a split layer of the list is a new module
        self.slice = LayerPieces(tuple(held), prefix)
        self.ties = CrossStageTies(owners, self.mesh)
        kept = {id(p) for index in held for p in layers[index].parameters()}
        for index, layer in enumerate(layers):
            if index not in held:
                release_shared(layer, kept)  # a tied Parameter stays whole on this stage
                layer.to("meta")  # frees the memory of layers other stages own
        self.module = nn.Sequential(*[layers[i] for i in held]).to(self._device)
        if chunks > 1:  # each chunk calls its own layers (shared with ``module``)
            self._chunk_modules = [nn.Sequential(*[layers[i] for i in p]) for p in pieces]

    def _full_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every name of this stage's parameters (tied ones under each name they have)."""
        if self.named is not None:
            own, pieces = self.named.plan.owner, self.named.pieces
            return [
                (n, p)
                for n, p in self.module.named_parameters(remove_duplicate=False)
                if own.get(n) in pieces
            ]
        named = self.module.named_parameters(remove_duplicate=False)
        return [(self.slice.canonical(n), p) for n, p in named]

    def _local_buffers(self) -> list[torch.Tensor]:
        if self.named is None:
            return list(self.module.buffers())
        return [b for b in self.module.buffers() if b.device.type != "meta"]

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params)

    def model_state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self._params, self.optimizer)

    # -- Engine interface ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.degrees.devices

    @property
    def model(self) -> nn.Module:
        """This worker's stage (the only layers it holds)."""
        return self.module

    def timeline_meta(self) -> dict[str, Any]:
        return {
            "stages": self.degrees.stages,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule_name,
            "flush": self.flush,
            "replicas": self.degrees.replicas,
            "tensor": self.degrees.tensor,
            "balance": self.balance,
            "recompute": self.recompute,
            **({"split_points": self.split_points} if self.split_points is not None else {}),
            **({"virtual_stages": len(self.chunks)} if len(self.chunks) > 1 else {}),
        }

    def timeline_identity(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.mesh.stage, "replica": self.mesh.replica}

    def records_timeline(self) -> bool:
        """A tensor group runs one schedule: its first member's events stand for it."""
        return self.mesh.tensor_rank == 0

    def run_metrics(self) -> dict[str, Any] | None:
        return self.split_metrics(self._params, self._parameters) or None

    def activation_peak_bytes(self) -> int:
        return self.memory.activation_peak_bytes() or 0

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        rounds, micro = self.gradient_accumulation, self.micro_batches
        replicas = self.mesh.replicas
        check_divisible(samples, replicas=replicas, micro_batches=rounds * micro)
        bytes_before = comm.bytes_sent()
        self.module.train()
        if self.buffer_sync is not None:
            self.buffer_sync.before_forward(training=True)
        if self.reducer is not None:
            self.reducer.zero_grad()
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        share_in = take_share(inputs, self.mesh.replica, replicas)
        share_tgt = take_share(targets, self.mesh.replica, replicas)
        self.memory.begin_step(self.steps_taken)
        parts = rounds * micro * replicas
        totals = LossTotals(self.loss_fn, targets, share_tgt, parts=parts, device=self._device)
        passes = StepPasses(
            self.stage_parts,
            totals=totals,
            loss_fn=self.loss_fn,
            reducer=self.reducer,
            items=self._num_items(inputs, parts),
            parts=parts,
        )
        for index, (round_in, round_tgt) in enumerate(
            zip(split_micro(share_in, rounds), split_micro(share_tgt, rounds), strict=True)
        ):
            final = index == rounds - 1
            passes.run_round(round_in, round_tgt, step=self.steps_taken + 1, final=final)
        loss = passes.loss
        if self.reducer is not None:
            loss = self.reducer.finish(extras_count=1)[0]
        self.ties.reduce_gradients()  # after the replicas' reduction, as Megatron does
        grads = (p.grad for p in self._params)  # read only under fp16
        finite = self.precision.unscale_and_check(grads, device=self._device)  # whole-job vote
        if finite and self.max_grad_norm is not None:
            self._clip()
        if finite and self.optimizer is not None:
            self.optimizer.step()
        self.steps_taken += 1
        self.memory.end_step()
        return self._step_stats(float(loss), samples, comm.bytes_sent() - bytes_before)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        replicas, micro = self.mesh.replicas, self.micro_batches
        check_divisible(batch_size(inputs), replicas=replicas, micro_batches=micro)
        was_training = self.module.training
        self.module.eval()
        if self.buffer_sync is not None:
            self.buffer_sync.before_forward(training=False)
        items = self._num_items(inputs, micro * replicas)
        share_in = split_micro(take_share(inputs, self.mesh.replica, replicas), micro)
        share_in = [part_inputs(one, items, micro * replicas, as_tensor=False) for one in share_in]
        share_tgt = split_micro(take_share(targets, self.mesh.replica, replicas), micro)
        for chunk in self.chunks:
            chunk.link.begin_round(micro, expect_loss=chunk.link is self.link)
        totals = LossTotals(
            self.loss_fn,
            targets,
            take_share(targets, self.mesh.replica, replicas),
            parts=micro * replicas,
            device=self._device,
        )
        for m, chunk in ((m, chunk) for m in range(micro) for chunk in self.chunks):
            inputs = to_device(share_in[m], self._device) if self._needs_inputs else None
            x = inputs if chunk.first else chunk.link.recv_activation(m)
            with self.precision.autocast(self._device):
                y = self._run_stage(x, chunk, recompute=False, inputs=inputs)
                if chunk.last:
                    totals.add(self.loss_fn(y, to_device(share_tgt[m], self._device)))
            if not chunk.last:
                chunk.link.send_activation(y, m)
        loss = pass_loss_back(self.mesh, self.link, totals.contribution)
        for chunk in self.chunks:
            chunk.link.flush()
        self.module.train(was_training)
        if replicas > 1:
            loss = loss.reshape(1)
            comm.all_reduce_sum(loss, group=self.mesh.dp_group)
        return float(loss.reshape(-1)[0])

    def tally(self, metric: Metric) -> Tally:
        """As every engine's, after making a vocab-split head's logits whole again: a
        tally reads them (accuracy, its own loss)."""
        self.loss_fn = vocab_loss.gathered(self.loss_fn, speaks=self._speaks)
        return super().tally(metric)

    def combine_tally(self, sums: torch.Tensor) -> torch.Tensor:
        """Only the last stage's loss sees predictions, each replica's its own share; the
        other stages hold zeros, so the sum over every worker is the whole batch's (and
        reaches rank 0, a first stage, which writes the metrics)."""
        return self.sum_over_workers(sums) if comm.world_size() > 1 else sums

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full canonical state on rank 0; on other ranks, their own stage's entries (every
        worker calls it: split layers are joined over each tensor group)."""
        own = self.named_local_state()
        if self.tensor_split is not None:
            own = self.tensor_split.whole_state(own)
        own = {key: value.detach().to("cpu", copy=True) for key, value in own.items()}
        gathered: list[Any] = [None] * dist.get_world_size() if comm.rank() == 0 else None
        sends = self.mesh.replica == 0 and self.mesh.tensor_rank == 0
        dist.gather_object(own if sends else {}, gathered, dst=0)
        if comm.rank() != 0:
            return own
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.tensor_split is not None:
            state = self.tensor_split.local_state(state)
        if self.named is not None:
            self.named.load(state)
        else:
            self.module.load_state_dict(self.slice.from_canonical(state))

    def named_local_state(self) -> dict[str, torch.Tensor]:
        if self.named is not None:
            return self.named.state()
        return self.slice.to_canonical(self.module.state_dict())

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.named is not None:
            return self.named.named_parameters()
        return [(self.slice.canonical(n), p) for n, p in self.module.named_parameters()]

    def tied_names(self) -> dict[str, str]:
        return self._tied_names

    def writes_shard(self) -> bool:
        return self.mesh.replica == 0

    def covers_whole_model(self) -> bool:
        return self.mesh.stages == 1

    def layout(self) -> dict[str, Any]:
        return {**super().layout(), **self.timeline_meta()}

    def _clip(self) -> None:
        """Clip by the norm over every stage (every worker takes part, a stage without
        parameters too). A Parameter tied across stages counts once, by the copy under
        its canonical name; replicas hold equal gradients, so the job's sum of squares
        holds each stage's ``replicas`` times."""
        aliases = self.tied_names()
        held = [(name, p.grad) for name, p in self.named_local_parameters() if p.grad is not None]
        counted = [(name, grad) for name, grad in held if name not in aliases]
        split, whole = [g for _, g in counted], []
        if self.tensor_split is not None:  # a replicated tensor: alike on each member
            split, whole = self.tensor_split.partition(counted)
        self._grad_norm = clip_distributed(
            split,
            self.max_grad_norm,
            device=self._device,
            copies=self.mesh.replicas,
            duplicates=[grad for name, grad in held if name in aliases],
            shared=whole,
            shared_by=self.mesh.tensor,
        )

    def _num_items(self, inputs: Any, parts: int) -> int | None:
        """``num_items_in_batch`` for a model cut at split points (``model_loss_items``):
        every stage runs the model's own forward on the micro-batch, the last one computing
        its loss from the labels, so each micro-batch's ``outputs.loss`` is its token sum
        over the global count times ``parts``, and the micro-batches' average the global
        token mean. A layer list's last stage sees activations only, never the labels: its
        loss is ``loss_fn``'s, which nothing here changes."""
        if self.named is None:
            return None
        return with_num_items(self.module, inputs, parts, self.loss_fn)

    @property
    def _needs_inputs(self) -> bool:
        """Every stage of a model cut at split points runs its forward from the inputs."""
        return self.mesh.is_first or self.named is not None

    def _run_stage(
        self,
        x: Any,
        chunk: Chunk,
        *,
        recompute: bool,
        inputs: Any = None,
        tape: LayerTape | None = None,
    ) -> Any:
        """The chunk's layers on ``x``: the first stage calls them as the whole model is
        called (a dict batch as keywords, a tuple as arguments; see ``inputs``); a later
        stage passes what it received as the one input, as ``nn.Sequential`` does between
        layers. With ``recompute`` only the stage's input is kept for backward. A model cut
        at split points runs its own forward on ``inputs`` (see ``stage_run``), the
        received tensors taking the place of the split block's arguments."""
        if self.named is not None:
            received = None if chunk.first else x
            run = functools.partial(self.named.run, inputs, received, chunk=chunk.index)
            if tape is None:
                return run()
            needs = [] if received is None else graph_leaves(x)
            return tape.run_piece(run, needs, leaves_of=graph_tensors)
        args, kwargs = as_arguments(x) if chunk.first else ((x,), {})
        if tape is not None:  # layer by layer, for a backward split into B and W
            return tape.run(chunk.module, args, kwargs, recompute=recompute)
        if recompute:
            return checkpoint(chunk.module, *args, use_reentrant=False, **kwargs)
        return chunk.module(*args, **kwargs)

    def _owners(self, chunk: Chunk) -> ChunkOwners:
        """A chunk's parameter owners for a round of a split backward (``ChunkOwners``)."""
        if self.named is not None:
            return ChunkOwners(*self.named.piece_owners(chunk.index))
        return ChunkOwners.of_layers(chunk.module)
