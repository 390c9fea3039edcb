"""The pipeline's own seconds per micro-batch on this machine, measured for the planner.

Beyond its layers' compute, each micro-batch a stage runs costs it messages (posting,
sending, waiting, being woken), the runner's bookkeeping and the passes' calls. The
planner's point-to-point line (a message to a waiting worker, ``planner/machine``) holds a
small part of it: on this 2-core machine a 2-stage pipeline of two 16-wide Linears (no
compute to speak of) took 2.2 ms a step at 1 micro-batch and 16.1 ms at 16 (medians, quiet
machine), 0.9 ms a micro-batch, while a message timed alone took 0.08 ms; the planner,
without it, predicted the default mlp's 2-stage 1F1B at 8 micro-batches at 0.41 of its
measured step and ranked the pipelines of many micro-batches first.

So every worker of a job builds a pipeline of a trivial model over all of them (one stage
each, GPipe, whose later micro-batches' messages never wait on a backward), steps it at
1 and at ``MICRO_BATCHES`` micro-batches, and the growth of its median step per
micro-batch is the figure (``pipeline/cost`` charges it to every stage's micro-batch,
once per chunk); the same under ZB-H1 is the figure of a stage that splits its backward
(a W pass a micro-batch, its units recorded and proved: 0.89 ms against GPipe's 0.78 on
this 2-core machine). The median, not the fastest step: the cost is made of waits that vary
from one micro-batch to the next, and a step is their sum.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from paratrain.parallel.strategy import create_engine
from paratrain.runtime import comm

MICRO_BATCHES = 8
STEPS = 16
"""Timed steps at each micro-batch count (one more, untimed, first)."""
WIDTH = 16


def micro_batch_seconds(schedules: tuple[str, ...] = ("gpipe",)) -> dict[str, float]:
    """Every worker of the job calls it; every worker gets the same figures, one per
    schedule. The pipelines step in turn, so that a slow patch of the machine slows all
    alike (stepped one after the other, 12 steps each, the figure came out 0.11 ms in one
    measurement and 0.5-0.96 ms in six others). A zero-bubble schedule's figure holds
    what its runner adds for the split backward (a W pass a micro-batch, the chunk's
    owners hooked each round, the units recorded and proved), and the split of the
    probe's own 16-wide layer, a few hundredths of a millisecond."""
    world = comm.world_size()
    engines = {}
    for schedule in schedules:
        for micro in (1, MICRO_BATCHES):
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(world)))
            engines[schedule, micro] = create_engine(
                "pipeline",
                model,
                stages=world,
                micro_batches=micro,
                schedule=schedule,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
                loss_fn=nn.functional.mse_loss,
            )
    inputs = torch.zeros(MICRO_BATCHES, WIDTH)
    seconds: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
    for _ in range(1 + STEPS):
        for key, engine in engines.items():
            comm.barrier("the pipeline probe")
            start = time.perf_counter()
            engine.train_step(inputs, inputs)
            seconds[key].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    # the slowest worker's medians, on every worker: a step ends when its last stage does
    medians = [statistics.median(times[1:]) for times in seconds.values()]
    steps = torch.tensor(medians, dtype=torch.float64)
    comm.all_reduce_max(steps)
    slowest = dict(zip(seconds, steps.tolist(), strict=True))
    return {
        schedule: max(0.0, (slowest[schedule, MICRO_BATCHES] - slowest[schedule, 1]))
        / (MICRO_BATCHES - 1)
        for schedule in schedules
    }
