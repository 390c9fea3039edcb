"""What an interleaved stage holds live, for the planner: its chunks' activations read off
its own actions. Pure arithmetic.

Under interleaved 1F1B a worker holds v chunks of the model, and the chunks need not be
alike: the first worker's first chunk may be an embedding that saves a micro-batch's
token ids, its second a transformer block that saves thousands of times more. Counting
every (micro-batch, chunk) pair in flight as ``1/v`` of the stage (``cost.in_flight``)
then misprices both the activations held and what a backward frees: on a 2-stage gpt of
2 blocks the first stage was predicted 24% over its live peak and the second 2.5% under.
So each chunk's saved bytes are counted on their own, walking the stage's actions
(``schedules.chunk_occupancy``, the walk ``max_in_flight`` makes with every pair 1): a
forward adds its chunk's, a backward frees them, and each backward's moment holds what
is in flight then, less its own pair, plus its own chunk's walk
(``live_cost.backward_peak``).
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.parallel.cost_model import ModelCosts, Run
from paratrain.parallel.live_cost import backward_peak, step_temporaries


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
