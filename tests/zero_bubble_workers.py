"""Zero-bubble runs for tests/test_zero_bubble.py and tests/test_interleaved_pipeline.py;
spawned workers import these by name."""

from __future__ import annotations

from tests import clip_workers, tie_workers, workers


def _run(what: str, kind: str, optimizer: str, options: dict):
    if what == "clip":
        return clip_workers.MAX_NORM, workers.parity_engine(
            "pipeline", kind, optimizer, max_grad_norm=clip_workers.MAX_NORM, **options
        )
    if what == "tied":
        return None, tie_workers.tied_engine("pipeline", kind, optimizer, **options)
    return None, workers.parity_engine("pipeline", kind, optimizer, **options)


def zero_bubble_worker(runs: list[tuple]) -> list[tuple[dict, list[float], list[str], bool]]:
    """Each (what, kind, optimizer, options): ``plain``, ``clip`` (clipped at
    ``clip_workers.MAX_NORM``; reports gradient norms) or ``tied`` (``tie_workers``'
    models); the final state, the losses (or norms), and the kinds of pass the run
    timed (``weight`` where the backward was split). Fails if a module of the model kept
    a forward hook after the steps (the split backward's are the round's only)."""
    out = []
    for what, kind, optimizer, options in runs:
        clip, engine = _run(what, kind, optimizer, options)
        batches = workers.parity_batches("gpt" if what == "tied" else kind)
        stats = [engine.train_step(x, y) for x, y in batches]
        values = [s.grad_norm if clip else s.loss for s in stats]
        hooked = [name for name, m in engine.module.named_modules() if m._forward_hooks]
        assert not hooked, f"forward hooks left on {hooked} after the steps"  # UnitHooks'
        kinds = sorted({event["kind"] for event in engine.events} - {"ready"})
        out.append((engine.state_dict(), values, kinds, engine.flush))
    return out
