"""A model's measured costs kept between plans: the second ``paratrain plan`` measures nothing.

Measuring a model takes its forward and backward some twenty times per precision and
tensor degree (a 50.6 M-parameter gpt over three tensor degrees: about a minute and a
half on 2 cores), and gives the same figures each time on the same machine. So each
``ModelCosts`` and ``OptimizerCost`` is written, as JSON (this program's own file, never
a pickle), under ``<cache>/costs/`` (``~/.cache/paratrain``; ``PARATRAIN_CACHE`` moves
it), named by a digest of everything the figures depend on:

- the machine (host name, cores this process may use), the torch version and the
  intra-op threads a worker runs with;
- the model: every module's class and ``repr`` (its sizes), every parameter's and
  buffer's name, shape, dtype and whether it trains, and the source of each module
  class's ``forward`` (an edited forward measures again);
- the sample's shapes and dtypes, the loss function's name and source, the precision,
  the tensor degree and the plan of split layers;
- this format's number, the measurement's settings (``REPEATS``, ``SIZE_BUDGET_S``) and
  a digest of paratrain's own source (``code_fingerprint``): figures or a refusal that
  other code measured are measured again (a refusal cached from a bug once outlived the
  fix until ``FORMAT`` moved).

The key is also stored inside the file and compared on reading, so a digest collision
or a hand-edited file measures again rather than answering for another model.
``refresh=True`` (``paratrain plan --refresh``) measures again and rewrites the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.parallel import cost_model
from paratrain.parallel.cost_model import Envelope, LayerCost, Line, ModelCosts, OptimizerCost
from paratrain.parallel.layer_profile import tensors_in
from paratrain.planner import measure
from paratrain.planner.machine import cache_root, cores, read_json, write_json

FORMAT = 12
"""Raised whenever what a measurement holds changes (2: live peaks, transient bytes and the
optimizer step's temporaries; 3: a layer's transient an ``Envelope`` of lines; 4: the
module listing; 5: a pass's fixed seconds, ``pass_s``; 9: a layer's seconds a ``Curve``
through four sizes, timed with gradients accumulated; 10: the pieces of a cut at named
blocks, ``ModelCosts.pieces``; 11: the loss's own live peak, ``loss_transient``; 12:
the layers a tied Parameter spans, ``tied_layers``), so
that a file of an older shape is measured again rather than read with defaults."""


def _code(code: Any) -> list[Any]:
    """A code object as data: its bytecode, names and constants (nested code objects
    likewise, never by their address)."""
    consts = [_code(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return [code.co_code.hex(), list(code.co_names), consts]


def _source(function: Any) -> Any:
    """A function's source, or its bytecode where no source is kept (``python -c``)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        code = getattr(function, "__code__", None)
        return _code(code) if code is not None else type(function).__qualname__


def _closure(function: Any) -> list[str]:
    """The values a function closes over and its default arguments (an object whose
    ``repr`` names its address makes a key no later process matches: measured again)."""
    cells = getattr(function, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            values.append(repr(cell.cell_contents))
        except ValueError:  # an empty cell
            values.append("")
    return [*values, repr(getattr(function, "__defaults__", None))]


def model_fingerprint(model: nn.Module) -> list[Any]:
    """What a measurement of ``model`` depends on, its weights' values aside."""
    classes = sorted(
        {type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)
    )
    return [
        repr(model),
        [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        [(c.__module__, c.__qualname__, _source(c.forward)) for c in classes],
    ]


def sample_fingerprint(sample: tuple[Any, Any]) -> list[Any]:
    return [[list(t.shape), str(t.dtype)] for part in sample for t in tensors_in(part)]


def machine_fingerprint(threads: int | None) -> list[Any]:
    return [platform.node(), cores(), torch.__version__, threads]


@functools.cache
def code_fingerprint() -> str:
    """A digest of every Python file of the paratrain package, names and contents, read
    once a process (about 200 files): an upgrade or an edit measures again."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _digest(key: Any) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _path(kind: str, key: Any) -> Path:
    return cache_root() / "costs" / f"{kind}-{_digest(key)}.json"


def cached(kind: str, key: Any, refresh: bool, compute: Callable[[], Any], to_json, from_json):
    """``compute()``'s figures, from the file ``key`` names unless ``refresh`` (then
    measured and written). A ``ValueError`` it raises (a split the model cannot take) is
    kept too, and raised again from the file."""
    full_key = [FORMAT, code_fingerprint(), measure.REPEATS, measure.SIZE_BUDGET_S, kind, key]
    path = _path(kind, full_key)
    if not refresh:
        data = read_json(path)
        if data is not None and data.get("key") == json.loads(json.dumps(full_key, default=str)):
            if "refused" in data:
                raise ValueError(data["refused"])
            try:
                return from_json(data["value"])
            except (KeyError, TypeError, ValueError):
                pass  # a file of another shape: measured again below
    try:
        value = compute()
    except ValueError as error:
        write_json(path, {"key": full_key, "refused": str(error)})
        raise
    write_json(path, {"key": full_key, "value": to_json(value)})
    return value


def costs_to_json(costs: ModelCosts) -> dict[str, Any]:
    """Everything but the optimizer (cached on its own, shared by every degree)."""
    data = dataclasses.asdict(costs)
    data.pop("optimizer")
    return data


def costs_from_json(data: dict[str, Any], optimizer: OptimizerCost) -> ModelCosts:
    lines = {f.name for f in dataclasses.fields(ModelCosts) if f.type in ("Line", Line)}
    layer_lines = {f.name for f in dataclasses.fields(LayerCost) if f.type in ("Line", Line)}

    def field_of(name: str, value: Any) -> Any:
        if name in layer_lines:
            return Line(**value)
        if name in ("time_s", "forward_s"):
            if "points" in value:
                return cost_model.Curve(tuple((float(x), float(y)) for x, y in value["points"]))
            return Line(**value)
        if name == "kept_bytes":
            return None if value is None else Line(**value)
        if name == "transient":
            return Envelope(tuple(Line(**line) for line in value["lines"]))
        return value

    layers = tuple(
        LayerCost(**{k: field_of(k, v) for k, v in layer.items()}) for layer in data["layers"]
    )
    rest = {k: Line(**v) if k in lines else v for k, v in data.items() if k != "layers"}
    rest["modules"] = tuple(tuple(module) for module in rest.get("modules", ()))
    rest["tied_layers"] = tuple(tuple(tie) for tie in rest.get("tied_layers", ()))
    return ModelCosts(layers=layers, optimizer=optimizer, **rest)


def optimizer_fingerprint(factory: Callable) -> list[Any]:
    """The optimizer factory's code and the values it closes over (its settings): the
    optimizer is not built for the key, since building torch's first optimizer imports
    its compiler, seconds that a plan answered from the cache should not pay."""
    return fingerprint_of(factory)


def optimizer_from_json(data: dict[str, Any]) -> OptimizerCost:
    return OptimizerCost(**data)


def fingerprint_of(function: Callable) -> list[Any]:
    """A function's name, source and closure (a ``functools.partial``: its function's and
    its arguments; a module: its class's forward and its ``repr``)."""
    inner = getattr(function, "func", function)
    bound = [repr(function.args), repr(function.keywords)] if inner is not function else []
    if isinstance(inner, nn.Module):
        cls = type(inner)
        return [cls.__module__, cls.__qualname__, repr(inner), _source(cls.forward)]
    name = getattr(inner, "__qualname__", type(inner).__qualname__)
    module = getattr(inner, "__module__", "") or ""
    return [module, name, _source(inner), _closure(inner), *bound]
