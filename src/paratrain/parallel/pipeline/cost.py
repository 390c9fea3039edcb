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

A step is ``m + stages - 1`` slots of the slowest stage's micro-batch (the bubble), each
with its sends' bytes and its passes' fixed work (``pass_overhead``: a forward and a
backward per chunk, B and W for zero-bubble, each paying what the whole model's one
forward and backward pays once), plus the messages a stage waits for idle
(``exposed_hops``), then the replicas' gradient all-reduce and the optimizer step, per
accumulation round.
Interleaved 1F1B idles ``(stages - 1) / v`` slots instead of ``stages - 1``; ZB-H1 idles
``stages - 1`` times ``F + B - W`` of the slowest stage, where B (the input's gradient)
and W (the weights') each take half the backward, so the idle is about one forward per
slot; ZB-H2's is read off its own lists replayed on that clock.
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
from paratrain.parallel.pipeline.schedules import (
    SPLIT_SCHEDULES,
    Action,
    build_schedule,
    chunk_occupancy,
    max_in_flight,
    timed_bubble,
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


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int, chunks: int = 1) -> float:
    """Stage ``stage``'s most micro-batches holding activations, in whole stages' worth
    (an interleaved (micro-batch, chunk) pair holds ``1/chunks`` of the stage's)."""
    peak = max_in_flight(build_schedule(schedule, stages, micro_batches, chunks))[stage]
    return peak / chunks if chunks > 1 else peak


def idle_slots(
    schedule: str, stages: int, chunks: int, forward_share: float, *, micro_batches: int
) -> float:
    """The bubble in slots of the slowest stage's micro-batch (``forward_share``: its
    forward's share of forward + backward, for ZB-H1's ``F + B - W``; ZB-H2's is its own
    action lists replayed on that clock, ``timed_bubble``)."""
    if schedule == "zb-h2":
        half = (1.0 - forward_share) / 2
        times = {"forward": forward_share, "backward": half, "weight": half}
        bubble = timed_bubble(build_schedule(schedule, stages, micro_batches), times)
        return micro_batches * bubble / (1.0 - bubble)  # idle / work = bubble / (1 - bubble)
    if schedule == "zb-h1":
        return (stages - 1) * forward_share  # F + B - W with B = W = backward / 2
    return (stages - 1) / chunks


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


def exposed_hops(schedule: str, stages: int, micro_batches: int) -> float:
    """Messages per round that a stage waits for idle, each a hop to a waiting worker
    (``MachineCosts.send``, timed that way): the first activation's ``stages - 1`` hops
    up (the fill) and the last gradient's ``stages - 1`` down (the drain). GPipe sends
    every later one while its receiver still computes. 1F1B holds at most ``stages``
    micro-batches on the first stage, so its steady state is a loop: the last stage's
    backward of micro-batch i, its gradient down to the first stage, that stage's forward
    of i + stages, its activation up: ``2 (stages - 1)`` hops per ``stages``
    micro-batches. ZB-H1, ZB-H2 and interleaved 1F1B are counted as 1F1B (not yet held against
    runs)."""
    fill_and_drain = 2 * (stages - 1)
    if schedule == "gpipe":
        return float(fill_and_drain)
    return fill_and_drain * max(1.0, micro_batches / stages)


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
    if not (unsplit.layer_list or unsplit.pieces):
        raise ValueError(
            "the model was measured whole; measure it per piece of its cut at named blocks "
            "(``ModelMeasurements.costs(pieces=True)``) to price a pipeline."
        )
    chunks = given(options, VIRTUAL_STAGES)
    micro = micro_batches_per_replica(stages, options.get(MICRO_BATCHES.name))
    schedule = given(options, SCHEDULE)
    recompute = bool(given(options, RECOMPUTE))
    split = schedule in SPLIT_SCHEDULES
    rounds = run.gradient_accumulation
    samples = run.global_batch / (replicas * rounds * micro)
    bounds = stage_bounds(balance(unsplit, stages * chunks, options, samples))
    actions = build_schedule(schedule, stages, micro, chunks)
    worst: dict[str, int] | None = None
    slowest = busy = forward_share = widest = 0.0
    largest_stage = 0
    for stage in range(stages):
        own = bounds[stage::stages]  # the (start, end) of each of its chunks
        layers = _worker_layers(bounds, stage, stages)
        held = in_flight(schedule, stages, stage, micro, chunks)
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
        if per_micro > slowest:
            slowest, forward_share = per_micro, costs.forward_time(samples, layers) / per_micro
        busy += per_micro
        largest_stage = max(largest_stage, costs.elements(layers))
    workers = replicas * stages * costs.tensor
    optimizer = costs.optimizer.step_s_per_element * largest_stage
    # every stage's micro-batches on every rank, against m + stages - 1 slowest-stage slots
    work = replicas * costs.tensor * (rounds * micro * busy + stages * optimizer)
    idle = idle_slots(schedule, stages, chunks, forward_share, micro_batches=micro)
    waits = exposed_hops(schedule, stages, micro) * machine.send.at(widest)
    compute = machine.compute_seconds(work, rounds * ((micro + idle) * slowest + waits) + optimizer)
    return Prediction.of(
        worst or {},
        compute_s=compute,
        communication_s=_collective_seconds(
            costs, machine, bounds, layout, rounds * micro, samples
        ),
        workers=workers,
        machine=machine,
        notes=(f"bubble {idle / (micro + idle):.0%}",),
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
