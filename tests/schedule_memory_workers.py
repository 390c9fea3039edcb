"""Per-stage activation peaks under each pipeline schedule, measured by the memory ledger
and read off the schedule's own action list, for tests/test_schedule_memory.py and
benchmarks/bench_schedule_memory.py (spawned workers import these by name)."""

from __future__ import annotations

from typing import Any

import torch

from paratrain.parallel.pipeline.schedules import build_schedule, max_in_flight, splits_backward

SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved": {"schedule": "1f1b", "virtual_stages": 2},
    "zb-h1": {"schedule": "zb-h1"},
    "zb-h2": {"schedule": "zb-h2"},
}
"""Bench names -> engine options (``interleaved``: 1f1b over 2 chunks per stage)."""

TEXTBOOK = {
    "gpipe": "m",
    "1f1b": "min(p-s, m)",
    "interleaved": "min(2(p-s-1) + (v-1)p + 1, vm) pairs",
    "zb-h1": "min(2p-1-s, m), F to W; the first stage fewer from p=4",
    "zb-h1 back to back": "steps back to back: up to the flushed lists' most (2p-1 at p=2)",
    "zb-h2": "min(2p-1, m), F to W",
}
"""Each schedule's activations in flight on stage s, as the docs state them."""


def _key(micro: int, chunk: int) -> Any:
    """The ledger's key of a pass (the engine's ``_key``)."""
    return micro if chunk == 0 else (micro, chunk)


def replayed_peak(actions: list, sizes: dict, *, split: bool) -> int:
    """The most bytes a stage holds at once when it keeps each (micro-batch, chunk)'s
    ``sizes`` from its F to its backward (its W where the backward is split), in the order
    of its action list: the schedule's theory for that stage, in bytes."""
    frees, held, peak = "W" if split else "B", 0, 0
    for action in actions:
        key = _key(action.micro, action.chunk)
        if action.kind == "F":
            held += sizes[key]
            peak = max(peak, held)
        elif action.kind == frees:
            held -= sizes[key]
    return peak


def stage_peaks(settings: list[tuple[str, dict]], model_options: dict, batch: int) -> list:
    """For each (bench name, pipeline options): this stage's ledger activation peak over
    2 steps of gpt, the peak its action list predicts from each pass's own saved bytes,
    the micro-batches (or pairs) in flight by the list, the bytes of one pass, and whether
    the engine's steps end together (the lists of ZB-H1 differ without)."""
    import paratrain
    from paratrain.models import build_model, loss_for
    from tests.workers import parity_optimizer

    out = []
    for name, options in settings:
        torch.manual_seed(0)
        engine = paratrain.setup(
            build_model("gpt", **model_options),
            optimizer=parity_optimizer("sgd"),
            loss_fn=loss_for("gpt"),
            strategy="pipeline",
            **SCHEDULES[name],
            **options,
        )
        sizes = _watch_releases(engine.memory.activations)
        generator = torch.Generator().manual_seed(0)
        vocab, length = model_options["vocab_size"], model_options["block_size"]
        for _ in range(2):
            x = torch.randint(0, vocab, (batch, length), generator=generator)
            engine.train_step(x, x)
        stage, layout = engine.mesh.stage, engine.degrees
        actions = build_schedule(
            engine.schedule_name,
            layout.stages,
            engine.micro_batches,
            layout.virtual_stages,
            flush=engine.flush,
        )
        split = splits_backward(actions)
        theory = replayed_peak(actions[stage], sizes, split=split)
        count = max_in_flight(actions)[stage]
        out.append(
            (
                name,
                stage,
                engine.activation_peak_bytes(),
                theory,
                count,
                max(sizes.values()),
                engine.flush,
            )
        )
    return out


def _watch_releases(meter) -> dict:
    """Each key's saved bytes as the ledger books them, read when its pass releases them
    (the last step's: every step saves the same shapes)."""
    sizes: dict = {}
    release = meter.release

    def recorded(key) -> None:
        sizes[key] = meter._bytes.get(key, 0)
        release(key)

    meter.release = recorded
    return sizes
