"""Worker functions for tests/test_planner.py (spawned workers import them by name)."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from paratrain.parallel.cost_model import Line, MachineCosts

STEPS = 3  # the ledger's steady peak is reached from the second step


def machine() -> MachineCosts:
    """Synthetic collectives, so that tests plan without measuring this machine."""
    lines = {n: Line(1e-3, 1e-9) for n in (2, 4, 8)}
    return MachineCosts(cores=8, backend="gloo", all_reduce=lines, send=Line(1e-3, 1e-9))


def model(kind: str):
    from paratrain.models import build_model

    if kind.startswith("hf-"):  # "hf-gpt2" (4 blocks, its head tied) or "hf-llama"
        from tests import hf_workers

        return hf_workers.build(kind[3:], layers=4 if kind == "hf-gpt2" else 2)
    torch.manual_seed(0)
    if kind == "gpt":
        return build_model("gpt", vocab_size=17, block_size=16, n_layer=2, n_head=4, n_embd=32)
    if kind == "gpt-wide":  # activations large beside the link buffers and headers
        return build_model("gpt", vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=128)
    if kind == "gpt-vocab":  # logits outweigh a block: the loss's backward is the peak
        return build_model("gpt", vocab_size=4096, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return build_model("mlp", in_features=32, hidden=64, depth=3, classes=10)


def batch(kind: str, size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    if kind.startswith("hf-"):
        from tests import hf_workers

        ids = torch.randint(0, hf_workers.VOCAB, (size, hf_workers.LENGTH), generator=generator)
        return {"input_ids": ids}, ids.clone()
    if kind.startswith("gpt"):
        length, vocab = {"gpt": (16, 17), "gpt-vocab": (16, 4096)}.get(kind, (32, 65))
        shape = (size, length)
        return (
            torch.randint(0, vocab, shape, generator=generator),
            torch.randint(0, vocab, shape, generator=generator),
        )
    return torch.randn(size, 32, generator=generator), torch.randint(
        0, 10, (size,), generator=generator
    )


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def loss(kind: str):
    from paratrain.losses import causal_lm_cross_entropy
    from paratrain.models import loss_for

    if kind.startswith("hf-"):
        return causal_lm_cross_entropy
    return loss_for("gpt" if kind.startswith("gpt") else "mlp")


def live_peaks(layouts: list[tuple[str, str, dict]], global_batch: int) -> list[int]:
    """Each (model, strategy, options) trained STEPS steps in turn in this job, inside an
    independent count of live storages (``LiveTensors``, entered before the model is
    built); every worker's live peak, for each layout (rank 0 gets the maxima)."""
    import paratrain
    from paratrain.runtime import comm
    from paratrain.runtime.live_tensors import LiveTensors

    peaks = []
    for kind, strategy, options in layouts:
        batches = [batch(kind, global_batch, seed=step) for step in range(STEPS)]
        with LiveTensors() as live:
            engine = paratrain.setup(
                model(kind), optimizer=adam, loss_fn=loss(kind), strategy=strategy, **options
            )
            for x, y in batches:
                engine.train_step(x, y)
        del engine
        peak = torch.tensor([float(live.peak)])
        if comm.distributed():
            gathered = [torch.zeros(1) for _ in range(comm.world_size())]
            torch.distributed.all_gather(gathered, peak)
            peak = max(gathered)
        peaks.append(int(peak.item()))
    return peaks


def auto_worker(budget: str | None, global_batch: int):
    """setup(strategy="auto") in every worker: the choice, the prediction, and the live
    peak (``LiveTensors``) of the chosen layout built again and trained STEPS steps."""
    import paratrain
    from paratrain.runtime.live_tensors import LiveTensors

    engine = paratrain.setup(
        model("gpt"),
        optimizer=adam,
        loss_fn=loss("gpt"),
        strategy="auto",
        global_batch=global_batch,
        sample=batch("gpt", global_batch),
        memory_per_device=budget,
    )
    batches = [batch("gpt", global_batch, seed=step) for step in range(STEPS)]
    plan, name = engine.plan, engine.name
    del engine  # built again inside the live count, as planned
    with LiveTensors() as live:
        engine = paratrain.setup(
            model("gpt"),
            optimizer=adam,
            loss_fn=loss("gpt"),
            strategy=plan.strategy,
            memory_per_device=budget,
            **plan.options,
        )
        for x, y in batches:
            engine.train_step(x, y)
    return {
        "strategy": plan.strategy,
        "options": plan.options,
        "predicted": plan.predicted_peak_bytes,
        "measured": live.peak,
        "engine": name,
    }


def wide(seed: int = 0):
    """An mlp whose optimizer step is a large share of its step: 2.6M parameters, a
    small batch (the probe's error once added seconds to a step of milliseconds)."""
    from paratrain.models import build_model

    torch.manual_seed(seed)
    return build_model("mlp", in_features=512, hidden=1024, depth=3, classes=10)


def wide_batch(size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 512, generator=generator)
    return inputs, torch.randint(0, 10, (size,), generator=generator)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def median_step_seconds(strategy: str, options: dict, global_batch: int, steps: int) -> float:
    """The median of ``steps`` timed train steps of ``wide`` after two untimed ones
    (allocation, the fused kernel's first call), every worker in step: what a step
    typically costs, the figure the planner predicts (its collectives priced as a step
    pays them, not at their fastest: ``test_planner.STEP_TIME_FACTOR``)."""
    import time

    import paratrain
    from paratrain.models import loss_for

    engine = paratrain.setup(
        wide(), optimizer=adamw, loss_fn=loss_for("mlp"), strategy=strategy, **options
    )
    seconds = []
    for step in range(2 + steps):
        batch = wide_batch(global_batch, seed=step)
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_step(*batch)
        if step >= 2:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def flat_times(costs, seconds: float):
    """``costs`` with every layer's forward and backward ``seconds`` (its forward a third),
    whatever the samples: the stages' times known, each at least 3/8 of the step's work
    (the mlp's 8 layers cut 3 + 5 by parameters), so that on one core the work, not the
    chain of slots, is the step at 4 and more micro-batches."""
    layers = tuple(
        dataclasses.replace(layer, time_s=Line(seconds, 0.0), forward_s=Line(seconds / 3, 0.0))
        for layer in costs.layers
    )
    return dataclasses.replace(costs, layers=layers)
