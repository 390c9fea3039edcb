"""Worker side of ``test_compiled_layers``: the parity models compiled as users compile."""

from __future__ import annotations

from collections.abc import Callable

import torch

import paratrain
from paratrain.models import loss_for
from tests import tp_workers, user_layers, workers


def compiled(kind: str, how: str, backend: str | Callable) -> torch.nn.Module:
    """``tp_workers.build(kind)`` (the parity mlp, or the tensor suite's gpt) compiled the
    ways users do (``how``; "not": left uncompiled): whole (``torch.compile(model)``), each
    layer of a layer list wrapped
    (``torch.compile(layer)``, an ``OptimizedModule``), or each module that owns
    parameters compiled in place (``module.compile()``, names unchanged); ``backend`` a
    backend's name or a backend of the caller's own."""
    model = tp_workers.build(kind)
    if how == "not":
        return model
    if how == "whole":
        return torch.compile(model, backend=backend)
    if how == "wrapped":
        return torch.nn.Sequential(*(torch.compile(layer, backend=backend) for layer in model))
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.compile(backend=backend)
    return model


def unwrapped(state: dict) -> dict:
    """A wrapped model's names carry ``_orig_mod.``; the reference's do not."""
    return {name.replace("_orig_mod.", ""): value for name, value in state.items()}


def train_compiled(kind: str, how: str, optimizer: str, backend: str, **options) -> dict:
    """10 steps of the compiled model under ``options``' engine; the final state."""
    engine = paratrain.setup(
        compiled(kind, how, backend),
        optimizer=workers.parity_optimizer(optimizer),
        loss_fn=loss_for(kind),
        **options,
    )
    for x, y in tp_workers.batches(kind):
        engine.train_step(x, y)
    return unwrapped(engine.state_dict())


def compiled_runs_worker(runs: list[tuple[str, str, str, dict]], backend: str) -> list[dict]:
    """Each (model, compile style, optimizer, engine options) trained; the final states.
    Dynamo forgets its compiled code between runs, each a fresh process's as under
    ``launch``: in one process, a model compiled under dp and then another under zero3
    failed in the second's compiled forward on a freed shard ("setStorage: ... out of
    bounds for storage of size 0"), as if handed code compiled without zero3's gathering
    hooks."""
    states = []
    for kind, how, optimizer, options in runs:
        torch._dynamo.reset()
        states.append(train_compiled(kind, how, optimizer, backend, **options))
    return states


def half_run_worker(how: str, options: dict, path: str, resume: bool) -> dict:
    """The parity mlp compiled ``how`` (backend "eager") under ``options``: the first 5 of
    the 10 parity steps, saved to ``path``; or (``resume``) loaded from ``path`` and the
    last 5. The final state, its names unwrapped."""
    engine = paratrain.setup(
        compiled("mlp", how, "eager"),
        optimizer=workers.parity_optimizer("adam"),
        loss_fn=loss_for("mlp"),
        **options,
    )
    batches = tp_workers.batches("mlp")
    if resume:
        engine.load_checkpoint(path)
    for x, y in batches[5:] if resume else batches[:5]:
        engine.train_step(x, y)
    if not resume:
        engine.save_checkpoint(path)
    return unwrapped(engine.state_dict())


def planned_run_worker(options: dict) -> dict:
    """``user_layers``' model cut at named blocks, compiled whole (backend "eager"),
    trained 10 Adam steps under the options a plan gave; the final state, unwrapped."""
    torch._dynamo.reset()
    model = torch.compile(user_layers.build("wrapped"), backend="eager")
    engine = paratrain.setup(
        model, optimizer=workers.parity_optimizer("adam"), loss_fn=loss_for("mlp"), **options
    )
    for x, y in tp_workers.batches("mlp"):
        engine.train_step(x, y)
    return unwrapped(engine.state_dict())


def graphs_compiled(kind: str, how: str, strategy: str) -> list[int]:
    """How many graphs dynamo has compiled (backend "eager") after each of 10 steps of
    ``kind`` compiled ``how`` under ``strategy``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = paratrain.setup(
        compiled(kind, how, "eager"),
        optimizer=workers.parity_optimizer("adam"),
        loss_fn=loss_for(kind),
        strategy=strategy,
    )
    return steps_counting_graphs(engine, kind)


def steps_counting_graphs(engine: paratrain.Engine, kind: str) -> list[int]:
    """``kind``'s parity batches through ``engine``: the graphs dynamo has compiled after
    each step."""
    graphs = []
    for x, y in tp_workers.batches(kind):
        engine.train_step(x, y)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return graphs


def pipeline_compiles(schedule: str, virtual_stages: int) -> dict:
    """The tests' gpt compiled whole (a backend that looks at each graph and runs it as
    dynamo made it), 10 Adam steps of ``schedule`` on 2 stages of 4 micro-batches: graphs
    after each step, the files the graphs' operations are written in, how many of their
    values are on the meta device (a shape-only stand-in's, compiled), dynamo's warnings,
    and the final state."""
    import warnings

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    files: set[str] = set()
    meta_values = 0

    def keep(graph: torch.fx.GraphModule, _inputs: list) -> object:
        nonlocal meta_values
        for node in graph.graph.nodes:
            value = node.meta.get("example_value", node.meta.get("val"))
            meta_values += isinstance(value, torch.Tensor) and value.device.type == "meta"
            frames = [  # the innermost one: where the operation is written
                line.strip().split('"')[1]
                for line in (node.meta.get("stack_trace") or "").splitlines()
                if line.strip().startswith('File "')
            ]
            files.update(frames[-1:])
        return graph.forward

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = paratrain.setup(
            compiled("gpt", "whole", keep),
            optimizer=workers.parity_optimizer("adam"),
            loss_fn=loss_for("gpt"),
            strategy="pipeline",
            stages=2,
            micro_batches=4,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        graphs = steps_counting_graphs(engine, "gpt")
    dynamo_warnings = sorted({str(w.message) for w in caught if "Dynamo" in str(w.message)})
    return {
        "graphs": graphs,
        "files": sorted(files),
        "meta_values": meta_values,
        "warnings": dynamo_warnings,
        "state": unwrapped(engine.state_dict()),
    }
