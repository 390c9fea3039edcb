"""The pipeline's arithmetic for the planner: each stage's ledger, and the step time.

Stages are cut as the engine cuts them (``partition`` on the unsplit model's layers: by
parameters unless ``balance_by`` or ``balance`` say otherwise); the worker whose ledger
peaks highest speaks for the plan. A stage holds its layers' parameters (its slices
under ``tensor``), their gradients (kept between steps in the replicas' buckets, set to
None at each step's start without replicas), their optimizer state, the activations of
the micro-batches its schedule has in flight (read off the schedule's own action lists,
``schedules.max_in_flight``: 1F1B ``min(stages - stage, m)``, GPipe all ``m``, interleaved
1F1B in (micro-batch, chunk) pairs of ``1/v`` of the stage each, ZB-H1 and ZB-H2 from F
to W, since W still holds each layer's graph; under ``recompute`` only each one's stage input:
the stage is checkpointed as one segment; ZB-H1 and ZB-H2 checkpoint each layer, so they
keep each layer's input and run the forward again in B and in W), and the point-to-point
buffers (``p2p``): the round's sends until the flush (activations and the header to the
next stage, input gradients and the loss to the previous one), and the gradient receives
posted for the micro-batches in flight.

A round is the schedule's own action lists placed on each stage's passes (``replay``,
the simulator's rules in seconds): each chunk's F, B and W (``chunk_passes``: its share
of the stage's micro-batch, which holds its layers' forward and backward, its sends'
bytes, the runner's own seconds and its passes' fixed work, ``pass_overhead``; a forward
and a backward per chunk, B and W for zero-bubble, each paying what the whole model's one
forward and backward pays once), and a hop to a waiting worker (``MachineCosts.send``)
on every message between two workers. So each schedule's bubble is its own on these
stages, unequal ones included (the last computes the loss; a zero-bubble first stage,
fed data, runs its whole backward as W), and a message costs the step only where the
lists wait for it: GPipe's fill and drain, 1F1B's steady loop at 2 stages, more
under interleaving (every chunk boundary crosses between workers), no more under ZB-H1
and ZB-H2. A new schedule needs no line here. Then the replicas' gradient all-reduce
and the optimizer step, per accumulation round.
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel.cost_model import MachineCosts, ModelCosts, Prediction, Run, ledger_at_peak
from paratrain.parallel.layer_profile import LayerProfile
from paratrain.parallel.layout import Layout
from paratrain.parallel.live_cost import (
    backward_peak,
    collective_lag,
    step_temporaries,
    with_transient,
)
from paratrain.parallel.options import given
from paratrain.parallel.pipeline.chunk_cost import chunk_moments
from paratrain.parallel.pipeline.options import (
    BALANCE,
    BALANCE_BY,
    MICRO_BATCHES,
    SCHEDULE,
    SPLIT_POINTS,
    VIRTUAL_STAGES,
    micro_batches_per_replica,
)
from paratrain.parallel.pipeline.partition import partition, stage_bounds, validate_balance
from paratrain.parallel.pipeline.replay import replay
from paratrain.parallel.pipeline.schedule_clock import back_to_back, steady_step
from paratrain.parallel.pipeline.schedules import (
    SPLIT_SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    chunk_occupancy,
    max_in_flight,
)
from paratrain.parallel.pipeline.split_cost import split_moments
from paratrain.parallel.pipeline.split_points import automatic_balance
from paratrain.parallel.pipeline.structure import HEADER_BYTES
from paratrain.parallel.recompute import RECOMPUTE
from paratrain.parallel.replica_cost import EXTRA_SLOT_BYTES

LOSS_BYTES = 4
MICRO_BATCH_FIGURE = "micro_batch_s"
"""The machine's figure of the runner's own seconds per micro-batch (``runner_probe``)."""
SPLIT_MICRO_BATCH_FIGURE = "split_micro_batch_s"
"""The same under a zero-bubble schedule, whose stages split their backward (a W pass
a micro-batch, its units recorded and proved); a machine file without it falls back on
``MICRO_BATCH_FIGURE``."""


def balance(unsplit: ModelCosts, stages: int, options: dict[str, Any], samples: float):
    """The engine's balance for this model (see ``choose_balance``); for a model cut at
    named blocks (``ModelCosts.pieces``), its split points' or, without them, the
    automatic cut's by parameter count (``split_points``)."""
    if unsplit.pieces:
        return _blocks_per_stage(unsplit, stages, options.get(SPLIT_POINTS.name))
    layers_per_stage = options.get(BALANCE.name)
    if layers_per_stage is not None:
        return validate_balance(layers_per_stage, layers=len(unsplit.layers), stages=stages)
    profiles = [
        LayerProfile(
            param_count=layer.all_param_elements,
            param_bytes=layer.param_bytes,
            forward_backward_s=max(layer.time_s.at(samples), 1e-9),
            activation_bytes=int(layer.saved.at(samples)),
        )
        for layer in unsplit.layers
    ]
    return partition(given(options, BALANCE_BY), profiles, stages)


def _blocks_per_stage(unsplit: ModelCosts, stages: int, split_points: list[str] | None):
    """Blocks per stage of a cut at named blocks: at ``split_points`` (each a block of
    the measured container), else where the engine's automatic cut puts them
    (``split_points.automatic_balance`` on each piece's parameter count)."""
    blocks = len(unsplit.layers)
    if split_points is None:
        return automatic_balance([layer.all_param_elements for layer in unsplit.layers], stages)
    starts = [0]
    for point in split_points:
        container, _, index = point.rpartition(".")
        if container != unsplit.pieces or not index.isdigit():
            raise ValueError(
                f"split point {point!r} is not a block of {unsplit.pieces!r}, the blocks the "
                "planner measured; name blocks of that container."
            )
        starts.append(int(index))
    return validate_balance(
        [b - a for a, b in zip(starts, [*starts[1:], blocks], strict=True)],
        layers=blocks,
        stages=stages,
    )


def in_flight(
    schedule: str,
    stages: int,
    stage: int,
    micro_batches: int,
    chunks: int = 1,
    *,
    flush: bool = True,
) -> float:
    """Stage ``stage``'s most micro-batches holding activations, in whole stages' worth
    (an interleaved (micro-batch, chunk) pair holds ``1/chunks`` of the stage's); ``flush``
    as ``build_schedule``'s."""
    lists = build_schedule(schedule, stages, micro_batches, chunks, flush=flush)
    peak = max_in_flight(lists)[stage]
    return peak / chunks if chunks > 1 else peak


def passes_per_micro_batch(split: bool, chunks: int) -> int:
    """A worker's passes per micro-batch: a forward and a backward of each of its chunks
    (virtual stages), the backward split into B and W under a zero-bubble schedule."""
    return (3 if split else 2) * chunks


def pass_overhead(costs: ModelCosts, samples: float, layers: list[int], passes: int) -> float:
    """Seconds a stage's micro-batch pays for its passes' fixed work beyond its layers'
    lines: ``passes`` times ``ModelCosts.pass_s``, less the share of the whole model's
    own pair of passes (``2 pass_s``) that the layers' lines already hold (they are the
    layers' times scaled to add up to the whole model's, so their share is the stage's
    share of its time). A stage holding the whole model pays nothing more; each further
    stage pays its own pair per micro-batch."""
    whole = costs.time(samples)
    share = costs.time(samples, layers) / whole if whole > 0 else 0.0
    return costs.pass_s * (passes - 2 * share)


def stage_memory(
    costs: ModelCosts,
    run: Run,
    samples: float,
    bounds: list[tuple[int, int]],
    held: int,
    one: float,
    communication: float,
    replicas: int,
    recompute: bool,
    steady: bool,
    actions: list[Action],
    split: bool,
) -> dict[str, int]:
    """A stage's ledger at its peak with ``held`` micro-batches of ``one`` saved bytes
    each, and what its live moments hold beyond it (``stage_moments``, and where its
    backward is ``split``, ``split_cost.split_moments`` on its ``actions``). ``bounds``:
    the (start, end) layers of each of its chunks; where it has several (interleaving),
    each chunk's activations are counted on their own along its actions
    (``chunk_cost``)."""
    pieces = [list(range(start, end)) for start, end in bounds]
    layers = [i for piece in pieces for i in piece]
    params = costs.param_bytes(layers)
    base = params + costs.frozen_bytes(layers) + costs.optimizer_bytes(layers) + communication
    if len(pieces) > 1:
        saved = [_saved_per_micro_batch(costs, run, samples, p, recompute, split) for p in pieces]
        activations, backwards = chunk_occupancy(actions, saved, "W" if split else "B")
        moments = chunk_moments(
            costs,
            run,
            samples,
            pieces,
            saved,
            backwards,
            base,
            replicas=replicas,
            recompute=recompute,
        )
    else:
        activations = held * one
        moments = stage_moments(
            costs, run, samples, layers, activations, one, base, replicas, recompute, steady
        )
    if split:
        moments += split_moments(
            costs,
            samples,
            layers,
            actions,
            base=base,
            one=one,
            grads_kept=replicas > 1,
            recompute=recompute,
        )
    memory = ledger_at_peak(
        parameters=params + costs.frozen_bytes(layers),
        gradients=params,
        optimizer=costs.optimizer_bytes(layers),
        activations=activations,
        communication=communication,
        gradients_persist=replicas > 1,
    )
    return with_transient(memory, moments=moments, lag=collective_lag(costs, samples))


def stage_moments(
    costs: ModelCosts,
    run: Run,
    samples: float,
    layers: list[int],
    saved: float,
    one: float,
    base: float,
    replicas: int,
    recompute: bool,
    steady: bool,
) -> tuple[float, float, float]:
    """A stage's live totals (``live_cost``) beyond ``base`` (its parameters, frozen state,
    optimizer state and link buffers): the backward of its first micro-batch while the
    others its schedule holds keep their activations (``saved`` in all, ``one`` each), the
    gradients made as backward passes (kept whole between steps only where replicas reduce
    them in buckets); a later backward, with every gradient there and, under 1F1B in its
    ``steady`` state (more micro-batches than it holds), as many micro-batches held (each
    backward follows a forward), else one fewer (GPipe drains); and the optimizer step
    (the fused kernel: ``fused_optim``)."""
    params = costs.param_bytes(layers)
    kept = replicas > 1

    def walk(grads_kept: bool) -> float:
        return backward_peak(
            costs,
            samples,
            layers,
            batch_samples=run.global_batch,
            recompute=recompute,
            one_segment=True,
            grads_kept=grads_kept,
        )

    first = base + (params if kept else 0.0) + max(0.0, saved - one) + walk(kept)
    later = base + params + max(0.0, saved - (1 if steady else 2) * one) + walk(True)
    largest = max((costs.layers[i].largest_param_elements for i in layers), default=0)
    step = base + params + step_temporaries(costs, largest, fused=True)
    return first, later, step


def chunk_passes(
    costs: ModelCosts,
    samples: float,
    pieces: list[tuple[int, int]],
    per_micro: float,
    *,
    split: bool,
    deferred: bool,
) -> list[tuple[float, float, float]]:
    """Each of a stage's chunks' seconds of F, B and W for one micro-batch, for the
    schedule's lists to be placed on (``placed_round``): the stage's ``per_micro``
    (``micro_batch_seconds``) shared by its chunks' layer time, each share's forward in
    the proportion of the stage's layers' forward to ``per_micro`` (what the stage adds
    beyond its layers' lines, a recompute's rerun included, falls to the backward).
    Under a split backward B and W take half the rest each (the layers' split factor is
    priced in ``per_micro``, not which half pays it); a first stage of one chunk
    (``deferred``) has no input gradient to make, so its B is empty and its W the whole
    backward, as the engine runs it (``LayerTape``)."""
    times = [costs.time(samples, list(range(start, end))) for start, end in pieces]
    total = sum(times)
    every = [i for start, end in pieces for i in range(start, end)]
    forward_share = costs.forward_time(samples, every) / per_micro if per_micro > 0 else 0.5
    out = []
    for time in times:
        seconds = per_micro * (time / total if total > 0 else 1 / len(pieces))
        forward = seconds * forward_share
        rest = seconds - forward
        if deferred:
            out.append((forward, 0.0, rest))
        elif split:
            out.append((forward, rest / 2, rest / 2))
        else:
            out.append((forward, rest, 0.0))
    return out


def placed_round(
    actions: Schedule, passes: list[list[tuple[float, float, float]]], hop_s: float
) -> tuple[float, float]:
    """A round's seconds, the schedule's lists placed on each stage's chunks' F, B and W
    (``chunk_passes``) with ``hop_s`` on every message between two workers (``replay``),
    and the busiest stage's idle share of it (the bubble a plan's notes give)."""
    placed = replay(actions, lambda s, c, kind: passes[s][c]["FBW".index(kind)], hop_s=hop_s)
    if placed.makespan <= 0:
        return 0.0, 0.0
    return placed.makespan, (placed.makespan - max(placed.busy)) / placed.makespan


def _steps_end_together(
    run: Run, layout: Layout, unsplit: ModelCosts, bounds: list[tuple[int, int]]
) -> bool:
    """Whether the engine will run the lists of steps that end together
    (``PipelineEngine._step_ends_together``): under fp16's vote, a tensor split or a tie
    across stages; and under clipping, which the planner is not told of (it prices the
    lists without, which hold no fewer micro-batches on any stage)."""
    return (
        run.precision == "fp16"
        or layout.tensor > 1
        or _ties_span_stages(unsplit, bounds, layout.stages)
    )


def _ties_span_stages(unsplit: ModelCosts, bounds: list[tuple[int, int]], stages: int) -> bool:
    """Whether a Parameter the measured layers share (``ModelCosts.tied_layers``) has
    copies on two stages of this cut (``bounds``: each piece's layers; piece ``j`` on
    stage ``j % stages``), as ``PipelineEngine``'s ``ties.spans_stages``."""
    stage_of = {
        layer: piece % stages
        for piece, (start, end) in enumerate(bounds)
        for layer in range(start, end)
    }
    return any(len({stage_of[layer] for layer in tie}) > 1 for tie in unsplit.tied_layers)


def _refuse_a_whole_measure(unsplit: ModelCosts) -> None:
    if not (unsplit.layer_list or unsplit.pieces):
        raise ValueError(
            "the model was measured whole; measure it per piece of its cut at named blocks "
            "(``ModelMeasurements.costs(pieces=True)``) to price a pipeline."
        )


def step_seconds(
    actions: Schedule,
    passes: list[list[tuple[float, float, float]]],
    hop_s: float,
    flush: bool,
    *,
    rounds: int,
    optimizer_s: list[float],
) -> tuple[float, float]:
    """A step's seconds and the busiest stage's idle share of it: with a ``flush``, its
    rounds' spans (``placed_round``) and the slowest stage's optimizer step, for which
    every stage waits; without, the period of steps placed back to back
    (``placed_steps``)."""
    if flush:
        span, idle = placed_round(actions, passes, hop_s)
        return rounds * span + max(optimizer_s), idle
    return placed_steps(actions, passes, hop_s, rounds=rounds, optimizer_s=optimizer_s)


def placed_steps(
    actions: Schedule,
    passes: list[list[tuple[float, float, float]]],
    hop_s: float,
    *,
    rounds: int,
    optimizer_s: list[float],
) -> tuple[float, float]:
    """A step's seconds where steps follow each other with no barrier (no ``flush``):
    each step ``rounds`` rounds of the lists, each stage's optimizer step
    (``optimizer_s``) after its last pass, the steps placed back to back
    (``schedule_clock.steady_step``), passes and hops as in ``placed_round``; and the
    busiest stage's idle share of it. A stage after the first may still run one step's
    W passes while the first runs the next step's forwards, so the step is shorter than
    its rounds' spans and the optimizer step end to end. The idle share counts the
    busiest stage's waiting for other stages, not its own optimizer step, as
    ``placed_round``'s counts a round's."""
    step = back_to_back(actions, rounds)

    def length(stage: int, action: Action) -> float:
        return passes[stage][action.chunk]["FBW".index(action.kind)]

    steady = steady_step(step, length, hop=hop_s, between=lambda stage: optimizer_s[stage])
    if steady.period <= 0:
        return 0.0, 0.0
    return steady.period, steady.waiting / steady.period


def micro_batch_seconds(
    costs: ModelCosts,
    machine: MachineCosts,
    samples: float,
    layers: list[int],
    boundaries: tuple[list[float], list[float]],
    recompute: bool,
    split: bool,
    chunks: int,
) -> float:
    """One micro-batch's seconds on a stage: its layers' forward and backward (under
    ``recompute`` the forward again, in B and in W where ``split``, and where ``split``
    what splitting the backward costs beyond one, ``split_extra_time``), the copies of the
    bytes it sends and receives (``boundaries``: ``_boundary_bytes``), the runner's own
    seconds per micro-batch and chunk (``runner_probe``: under a split backward, the
    zero-bubble runner's) and its passes' fixed work."""
    outs, grads_in = boundaries
    reruns = (2 if split else 1) if recompute else 0  # B and W each re-run it
    seconds = costs.time(samples, layers) + reruns * costs.forward_time(samples, layers)
    if split:  # F recording the weight modules' calls, B keeping the graph, W walking it
        seconds += costs.split_extra_time(samples, layers)
    seconds += machine.send.slope * (sum(outs) + sum(grads_in))  # the bytes' copies
    runner = machine.figure("pipeline", MICRO_BATCH_FIGURE)
    if split:
        runner = machine.figure("pipeline", SPLIT_MICRO_BATCH_FIGURE) or runner
    seconds += chunks * runner
    return seconds + pass_overhead(costs, samples, layers, passes_per_micro_batch(split, chunks))


def predict(
    costs: ModelCosts,
    unsplit: ModelCosts,
    machine: MachineCosts,
    run: Run,
    options: dict[str, Any],
    *,
    layout: Layout,
) -> Prediction:
    replicas, stages = layout.replicas, layout.stages
    _refuse_a_whole_measure(unsplit)
    chunks = given(options, VIRTUAL_STAGES)
    micro = micro_batches_per_replica(stages, options.get(MICRO_BATCHES.name))
    schedule = given(options, SCHEDULE)
    recompute = bool(given(options, RECOMPUTE))
    split = schedule in SPLIT_SCHEDULES
    rounds = run.gradient_accumulation
    samples = run.global_batch / (replicas * rounds * micro)
    bounds = stage_bounds(balance(unsplit, stages * chunks, options, samples))
    flush = _steps_end_together(run, layout, unsplit, bounds)
    actions = build_schedule(schedule, stages, micro, chunks, flush=flush)
    worst: dict[str, int] | None = None
    busy = widest = 0.0
    elements: list[int] = []
    passes: list[list[tuple[float, float, float]]] = []  # each stage's chunks' F, B, W
    for stage in range(stages):
        own = bounds[stage::stages]  # the (start, end) of each of its chunks
        layers = _worker_layers(bounds, stage, stages)
        held = in_flight(schedule, stages, stage, micro, chunks, flush=flush)
        one = _saved_per_micro_batch(costs, run, samples, layers, recompute, split)
        first, last = stage == 0, stage == stages - 1
        outs, grads_in = _boundary_bytes(costs, own, samples, first, last)
        communication = _link_bytes(outs, grads_in, micro, held, first=first)
        communication += EXTRA_SLOT_BYTES // 2 if replicas > 1 else 0
        widest = max([widest, *outs])
        steady = schedule != "gpipe" and micro > held
        split_here = _stage_splits(split, stage, chunks)
        memory = stage_memory(
            costs,
            run,
            samples,
            own,
            held,
            one,
            communication,
            replicas,
            recompute,
            steady,
            actions[stage],
            split_here,
        )
        if worst is None or sum(memory.values()) > sum(worst.values()):
            worst = memory
        per_micro = micro_batch_seconds(
            costs, machine, samples, layers, (outs, grads_in), recompute, split_here, chunks
        )
        deferred = split and not split_here  # the first stage: its whole backward is W
        passes.append(chunk_passes(costs, samples, own, per_micro, split=split, deferred=deferred))
        busy += per_micro
        elements.append(costs.elements(layers))
    optimizers = [costs.optimizer.step_s_per_element * count for count in elements]
    # every stage's micro-batches on every rank, against the schedule's own lists placed
    # on these passes, each message between two workers a hop to a waiting one
    work = replicas * costs.tensor * (rounds * micro * busy + stages * max(optimizers))
    hop = machine.send.at(widest)
    step, idle = step_seconds(actions, passes, hop, flush, rounds=rounds, optimizer_s=optimizers)
    compute = machine.compute_seconds(work, step)
    return Prediction.of(
        worst or {},
        compute_s=compute,
        communication_s=_collective_seconds(
            costs, machine, bounds, layout, rounds * micro, samples
        ),
        workers=replicas * stages * costs.tensor,
        machine=machine,
        notes=(f"bubble {idle:.0%}",),
    )


def _collective_seconds(
    costs: ModelCosts,
    machine: MachineCosts,
    bounds: list[tuple[int, int]],
    layout: Layout,
    micro_batches: int,
    samples: float,
) -> float:
    """The replicas' all-reduce of the largest stage's gradients, and the tensor group's
    messages of ``micro_batches`` micro-batches (a stage's share of the model's)."""
    stages = layout.stages
    params_largest = max(
        costs.param_bytes(_worker_layers(bounds, s, stages)) for s in range(stages)
    )
    return machine.all_reduce_s(params_largest, layout.replicas) + machine.all_reduce_s(
        micro_batches * costs.tensor_bytes.at(samples) / stages,
        costs.tensor,
        messages=micro_batches * costs.tensor_messages.at(samples) / stages,
    )


def _saved_per_micro_batch(
    costs: ModelCosts, run: Run, samples: float, layers: list[int], recompute: bool, split: bool
) -> float:
    """What a stage's micro-batch keeps for its backward: its layers' saved tensors, or
    under ``recompute`` the inputs of its segments (a split backward checkpoints layer by
    layer, ``LayerTape``; else the stage is one segment)."""
    if recompute:
        return costs.recomputed_saved(
            samples, layers, batch_samples=run.global_batch, one_segment=not split
        )
    return costs.saved(samples, layers, batch_samples=run.global_batch)


def _stage_splits(split: bool, stage: int, chunks: int) -> bool:
    """Whether a stage's backward runs split. A chunk fed data has no input gradient to
    send: its B does nothing and its W is one whole backward (``LayerTape``), so the first
    stage of one chunk holds and walks as a plain backward does, W in its place."""
    return split and not (stage == 0 and chunks == 1)


def _link_bytes(
    outs: list[float], grads_in: list[float], micro: int, held: float, *, first: bool
) -> float:
    """A stage's point-to-point buffers at their most: the round's sends until the flush
    (activations and a header per chunk that sends on, input gradients per chunk that has
    a previous one, the first stage's later chunks' too under interleaving, and the loss),
    the gradient receives posted for the micro-batches in flight, and a header receive per
    chunk that has a previous one (posted at the round's start)."""
    sends = micro * sum(outs) + HEADER_BYTES * len(outs) + micro * sum(grads_in)
    sends += 0 if first else LOSS_BYTES
    return sends + held * sum(outs) + HEADER_BYTES * len(grads_in)


def _boundary_bytes(
    costs: ModelCosts, pieces: list[tuple[int, int]], samples: float, first: bool, last: bool
) -> tuple[list[float], list[float]]:
    """Per micro-batch, the activations a stage's chunks send on, and the input gradients
    they send back (the first stage's first chunk and the last stage's last chunk none)."""
    outs = [costs.layers[end - 1].output_bytes.at(samples) for _, end in pieces]
    grads_in = [costs.layers[start].input_bytes.at(samples) for start, _ in pieces]
    return (outs[:-1] if last else outs), (grads_in[1:] if first else grads_in)


def _worker_layers(bounds: list[tuple[int, int]], stage: int, stages: int) -> list[int]:
    """The layers stage ``stage`` holds: its pieces ``stage, stage + stages, ...``."""
    return [i for start, end in bounds[stage::stages] for i in range(start, end)]
