"""Worker functions for the parameter-server tests (spawned workers import them by name)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain
from paratrain.data import build_dataset
from paratrain.models import build_model, loss_for
from tests import workers


def ps_parity_worker(cases: list[tuple[tuple, dict]]) -> list[tuple[dict, list[float], str]]:
    """Each (parity case, ps options) for 10 steps: the final state, this share's losses and
    the transport the engine used."""
    results = []
    for case, options in cases:
        engine = workers.parity_engine("ps", *case, **options)
        losses = [engine.train_step(x, y).loss for x, y in workers.parity_batches(case[0])]
        results.append((engine.state_dict(), losses, engine.layout()["transport"]))
        engine.close()
    return results


def convergence_data(kind: str, data_dir: str | None, steps: int, batch: int):
    """The same global batches everywhere, and a held-out batch to measure the loss on."""
    if kind == "lenet":
        bundle = build_dataset("synthetic_images", synthetic_size=steps * batch, seed=0)
    else:
        bundle = build_dataset("shakespeare", data_dir=data_dir, block_size=32)
    generator = torch.Generator().manual_seed(5)
    order = torch.randperm(len(bundle.train), generator=generator)[: steps * batch]
    train = [bundle.train[order[i * batch : (i + 1) * batch]] for i in range(steps)]
    held_out = bundle.val[: 4 * batch]
    return bundle, train, held_out


def convergence_model(kind: str, bundle):
    torch.manual_seed(0)
    if kind == "lenet":
        return build_model("lenet", classes=bundle.num_classes)
    return build_model(
        "gpt", vocab_size=bundle.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32
    )


def convergence_optimizer(name: str):
    """ "adam:LR" or "sgd:LR:MOMENTUM"."""
    kind, *values = name.split(":")
    if kind == "adam":
        return lambda params: torch.optim.Adam(params, lr=float(values[0]))
    return lambda params: torch.optim.SGD(params, lr=float(values[0]), momentum=float(values[1]))


def convergence_worker(
    kind: str, optimizer: str, data_dir: str | None, steps: int, batch: int, settings: list[dict]
) -> list[dict]:
    """Train under each ps setting; after every worker is done, worker 0 reads the state."""
    bundle, train, _ = convergence_data(kind, data_dir, steps, batch)
    results = []
    for options in settings:
        engine = paratrain.setup(
            convergence_model(kind, bundle),
            optimizer=convergence_optimizer(optimizer),
            loss_fn=loss_for(kind),
            strategy="ps",
            **options,
        )
        for x, y in train:
            engine.train_step(x, y)
        dist.barrier()  # test only: every push of every worker is in before reading
        results.append({"state": engine.state_dict(), "metrics": engine.ps_metrics()})
        engine.close()
    return results


def straggler_worker(settings: list[dict], budget: int, batch: int) -> list[dict]:
    """Under each setting, train until the servers applied ``budget`` samples."""
    results = []
    for options in settings:
        engine = workers.parity_engine("ps", "mlp", "sgd", **options)
        x, y = workers.parity_batches("mlp", steps=1, batch=batch)[0]
        while engine.server_samples < budget:
            engine.train_step(x, y)
        engine.finish()  # stopping early: nobody may wait for this worker any more
        dist.barrier()  # test only: read the metrics once every worker stopped pushing
        results.append({"steps": engine.steps_taken, "metrics": engine.ps_metrics()})
        engine.close()
    return results


def straggler_timeline(steps: int, straggler_rank: int) -> list[tuple[str, float]] | None:
    """The straggler's pulls, sleeps and computes in order (its sleeps recorded, not slept),
    with each sleep's length; None on the other workers."""
    from types import SimpleNamespace

    from paratrain.parallel.ps import engine as ps_engine

    engine = workers.parity_engine(
        "ps", "mlp", "sgd", staleness=None, straggler={"rank": straggler_rank, "slowdown": 3.0}
    )
    events: list[tuple[str, float]] = []
    ps_engine.time = SimpleNamespace(  # this worker process only
        perf_counter=ps_engine.time.perf_counter,
        sleep=lambda seconds: events.append(("sleep", seconds)),
    )
    pull = engine._pull
    engine._pull = lambda **kw: (pull(**kw), events.append(("pull", 0.0)))
    engine.model.register_forward_pre_hook(lambda *_: events.append(("compute", 0.0)))
    for x, y in workers.parity_batches("mlp", steps=steps, batch=24):
        engine.train_step(x, y)
    engine.close()
    return events if dist.get_rank() == straggler_rank else None


def lose_a_worker(options: dict, steps: int, kill_rank: int, kill_step: int) -> dict:
    """``kill_rank`` SIGKILLs itself before step ``kill_step``; the others train on."""
    engine = workers.parity_engine("ps", "mlp", "sgd", **options)
    batches = workers.parity_batches("mlp", steps=steps, batch=24)
    for step, (x, y) in enumerate(batches, start=1):
        if dist.get_rank() == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        engine.train_step(x, y)
    metrics = engine.ps_metrics()
    pids = engine.server_pids
    engine.close()
    return {"steps": engine.steps_taken, "metrics": metrics, "server_pids": pids}


def lose_a_server(options: dict, pid_file: str, kill_step: int) -> None:
    """Worker 0 SIGKILLs server 0 before step ``kill_step``; every worker must then fail."""
    engine = workers.parity_engine("ps", "mlp", "sgd", **options)
    if dist.get_rank() == 0:
        Path(pid_file).write_text(" ".join(map(str, engine.server_pids)))
    for step, (x, y) in enumerate(workers.parity_batches("mlp", steps=50), start=1):
        if dist.get_rank() == 0 and step == kill_step:
            os.kill(engine.server_pids[0], signal.SIGKILL)
        engine.train_step(x, y)


def precision_cases(runs: list[tuple[str, tuple, dict]]) -> list[dict]:
    """Each (strategy, parity case, options) in one launch: losses, skips, scales, the state.

    ``options["precision_by_rank"]`` gives each rank its own precision (one worker forced
    to overflow). A ps run reads its state after every worker finished, and its metrics.
    ``options["checkpoint"]``: worker 0 then saves there, forgets its loss scale, loads the
    checkpoint and reports the precision state before and after (one worker only: under
    ps another worker's load could start before the save was published).
    """
    from paratrain.parallel.precision import Precision
    from tests import mem_workers

    results = []
    for strategy, (kind, optimizer, batches), options in runs:
        options = dict(options)
        by_rank = options.pop("precision_by_rank", None)
        checkpoint = options.pop("checkpoint", None)
        if by_rank is not None:
            options["precision"] = by_rank[dist.get_rank()]
        engine = workers.parity_engine(strategy, kind, optimizer, **options)
        if batches == "parity":
            steps = workers.parity_batches(kind)
        else:
            steps = mem_workers.memo_batches(kind)
        stats = [engine.train_step(x, y) for x, y in steps]
        result = {
            "losses": [s.loss for s in stats],
            "skipped": [s.skipped_steps for s in stats],
            "scales": [s.loss_scale for s in stats],
        }
        if strategy == "ps":
            engine.finish(wait=True)  # every worker's pushes are in before reading
            result["metrics"] = engine.ps_metrics()
        result["state"] = engine.state_dict()
        if checkpoint is not None and dist.get_rank() == 0:
            saved = engine.precision.state_dict()
            engine.save_checkpoint(checkpoint)
            engine.precision = Precision(engine.precision.name)
            engine.load_checkpoint(checkpoint)
            result["precision"] = (saved, engine.precision.state_dict())
        if strategy == "ps":
            engine.close()
        results.append(result)
    return results
