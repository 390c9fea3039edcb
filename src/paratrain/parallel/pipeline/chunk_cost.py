"""What an interleaved stage holds live, for the planner: its chunks' activations read off
its own actions. Pure arithmetic.

Under interleaved 1F1B a worker holds v chunks of the model, and the chunks need not be
alike: the first worker's first chunk may be an embedding that saves a micro-batch's
token ids, its second a transformer block that saves thousands of times more. Counting
every (micro-batch, chunk) pair in flight as ``1/v`` of the stage (``cost.in_flight``)
then misprices both the activations held and what a backward frees: on a 2-stage gpt of
2 blocks the first stage was predicted 24% over its live peak and the second 2.5% under.
So each chunk's saved bytes are counted on their own, walking the stage's actions: a
forward adds its chunk's, a backward frees them (its W where the backward is split), and
each backward's moment holds what is in flight then, less its own pair, plus its own
chunk's walk (``live_cost.backward_peak``).
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.parallel.cost_model import ModelCosts, Run
from paratrain.parallel.live_cost import backward_peak, step_temporaries
from paratrain.parallel.pipeline.schedules import Action


def chunk_occupancy(
    actions: list[Action], saved: Sequence[float]
) -> tuple[float, list[tuple[float, int]]]:
    """The most bytes a stage's chunks hold at once (``saved[c]`` per micro-batch of chunk
    c, from its forward to its backward: its W where the backward is split), and at each
    backward that frees a pair, the bytes held then (that pair included) and its chunk."""
    frees = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0.0
    backwards = []
    for action in actions:
        if action.kind == "F":
            held += saved[action.chunk]
            peak = max(peak, held)
        elif action.kind == frees:
            backwards.append((held, action.chunk))
            held -= saved[action.chunk]
    return peak, backwards


def chunk_moments(
    costs: ModelCosts,
    run: Run,
    samples: float,
    pieces: list[list[int]],
    saved: Sequence[float],
    backwards: list[tuple[float, int]],
    base: float,
    *,
    replicas: int,
    recompute: bool,
) -> tuple[float, ...]:
    """A stage's live totals at each of its backwards and at its optimizer step: ``base``
    (parameters, frozen state, optimizer state, link buffers), the gradients (at the
    first backward only where replicas keep them between steps; at later ones all, as
    ``cost.stage_moments`` counts them), what is in flight less the pair walked, and the
    walk through that chunk's layers."""
    layers = [i for piece in pieces for i in piece]
    params = costs.param_bytes(layers)
    kept = replicas > 1
    moments = []
    for index, (held, chunk) in enumerate(backwards):
        grads_there = kept or index > 0
        walk = backward_peak(
            costs,
            samples,
            pieces[chunk],
            batch_samples=run.global_batch,
            recompute=recompute,
            one_segment=True,
            grads_kept=grads_there,
        )
        moments.append(base + (params if grads_there else 0.0) + held - saved[chunk] + walk)
    largest = max((costs.layers[i].largest_param_elements for i in layers), default=0)
    return (*moments, base + params + step_temporaries(costs, largest, fused=True))
