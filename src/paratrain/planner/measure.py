"""Measuring a model for the planner: per layer, what it holds, saves and takes, on one process.

The sample runs through the model at two micro-batch sizes (the costs are lines in the
size), forward and backward with the loss, under the run's precision, as an engine runs
it; per layer of the layer list (the whole model where it is none) this records:

- the bytes of its trainable and frozen parameters (``frozen``: buffers too);
- the bytes autograd saves during its forward that no earlier layer saved (each storage
  once, parameters left out: what the engines' ledgers book as activations), the loss's
  saved tensors kept apart (``loss_saved``: the last stage books them, and a recomputed
  model keeps them whole), and the loss's own live peak alone on the model's outputs
  (``loss_transient``: cross-entropy's log-probabilities, their gradient and the logits'
  gradient at once, backward's first moment);
- the bytes of saved storages an earlier layer made (a stage starting here receives its
  own copy), of its input (what a recompute segment keeps), and of its output (what
  crosses a stage boundary after it);
- the seconds of its forward and of its forward and backward, each the fastest of a few
  timed runs of that layer alone on its recorded input, scaled so that the layers add up
  to the measured forward and backward of the whole model with its loss (a layer timed
  alone pays the call overheads that one backward through the whole graph shares);
  layers of one signature (class, sizes, parameter and input shapes: a transformer's
  blocks) are timed once for all (``block_signature``);
- where a zero-bubble schedule can split its backward, how many times its plain forward
  and backward the split one takes (the engine's F, B and W, timed in turn with them:
  ``LayerCost.split_factor``);
- once, the fixed seconds of a pass called on its own (``ModelCosts.pass_s``,
  ``_pass_seconds``), which a pipeline stage pays per pass beyond its layers' lines.

Times are taken with the intra-op threads a worker gets (``threads``; the launcher gives
each of N workers ``cores // N``), so they are a worker's.

The batch's own tensors are kept apart (``ModelCosts.inputs_saved``, ``targets_saved``):
an engine hands a worker its share as a view of the global batch, so where the first
layer saves its input (an embedding its token ids) or the loss its targets, the ledger
books the whole batch's storage (on the CPU, where moving it to the device copies
nothing), whatever the micro-batch.

A tensor degree above 1 is measured on a copy of the model split as rank 0 of a tensor
group would hold it (``tensor/mappings.LOCAL``: the operators count their messages and
send nothing), so its slices' bytes, the activations it saves and its compute are the
split worker's, and the messages per micro-batch are counted.

Nothing of the model changes: gradients are taken with ``torch.autograd.grad`` (a split
backward's W, which accumulates, puts back the ``.grad`` it found), buffers (BatchNorm
statistics) are restored, and the random state is put back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from paratrain.parallel.batching import batch_size, map_tensors
from paratrain.parallel.cost_model import (
    Curve,
    Envelope,
    LayerCost,
    Line,
    ModelCosts,
    OptimizerCost,
)
from paratrain.parallel.fused_optim import with_fused_kernel
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layer_profile import (
    detached,
    fresh_leaves,
    map_output_tensors,
    storage_key,
    tensors_in,
)
from paratrain.parallel.layers import is_layer_list, layer_list
from paratrain.parallel.piece_runs import PieceRun, PieceRuns, automatic_container
from paratrain.parallel.precision import Precision
from paratrain.parallel.split_backward_kept import kept_for_weight_pass
from paratrain.parallel.split_backward_time import split_layer_pass
from paratrain.parallel.strategy import optimizer_from_factory
from paratrain.parallel.tensor import mappings
from paratrain.parallel.tensor.apply import apply_plan
from paratrain.parallel.tensor.plan import resolve_plan
from paratrain.planner.compiled_models import as_written
from paratrain.runtime.live_tensors import LiveTensors

REPEATS = 3
"""Timed runs per layer and size (the fastest is kept), after one untimed run."""
OPTIMIZER_REPEATS = 10
"""Timed steps of the optimizer probe (the fastest is kept): a step of 65,536 elements
takes well under a millisecond, so ten cost nothing and outlast another process's
interruptions."""

PASS_REPEATS = 20
"""Timed runs of the one-element pass (``_pass_seconds``): each takes some 20 microseconds,
so twenty cost nothing and outlast another process's interruptions."""

TIMED_FRACTIONS = (2, 4, 8)
"""Besides the largest micro-batch measured, the whole model's forward and backward is
timed at these fractions of it (``Curve``): the plans give workers micro-batches down to
an eighth of the sample (8 micro-batches a replica), where time is no line."""

TIMED_SECONDS = 0.1
"""How long the runs of one size may take in all before the smaller sizes stop being timed
more often than the largest (``_training_seconds``)."""

SIZE_BUDGET_S = 2.0
"""The longest one forward and backward of the whole model may take at the larger size
measured. Measuring runs the model some 18 times over per precision and tensor degree, so
a large model on a large sample would take minutes (6.5 minutes for ``paratrain plan --model gpt
--n-embd 1024 --devices 8 --global-batch 64`` on 2 cores); above this the sizes stop
short of the sample's (down to 1 and 2 samples) and the costs, lines in the micro-batch,
are extrapolated along them to the sizes the plans give a worker. Bytes are exact lines;
seconds per sample fall a little with the size (that gpt on one thread: 0.225 s per
sample at 4, 0.217 at 64), so a time extrapolated from small sizes errs low (by 7% for
that gpt from 4 and 8 samples to 64)."""


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _first(value: Any, samples: int) -> Any:
    """The first ``samples`` samples of a batch, each tensor a contiguous copy."""
    if value is None:
        return None
    return map_tensors(value, lambda t: t.narrow(0, 0, samples).contiguous().clone())


def _first_of(sample: tuple[Any, Any], samples: int) -> tuple[Any, Any]:
    """The first ``samples`` samples of (inputs, targets)."""
    return _first(sample[0], samples), _first(sample[1], samples)


@contextmanager
def _untouched(model: nn.Module):
    """Buffers and the random state as they were, whatever the measurement did."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def _scalar(loss: Any) -> Tensor:
    """The loss a step backpropagates: a ``(sum, count)`` pair divided by the count, as
    the engines divide it."""
    if isinstance(loss, tuple):
        return loss[0] / max(1.0, float(loss[1]))
    return loss


class _Trace:
    """One forward and backward of the whole model, attributing saved storages to layers."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        self.model, self.layers = model, layers
        self.owned = {storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
        count = len(layers)
        self.saved, self.input_saved = [0] * count, [0] * count
        self.input_bytes, self.output_bytes = [0] * count, [0] * count
        self.inputs: list[Any] = [None] * count
        self.current = 0
        self.first_layer: dict[int, int] = {}
        self.batch: dict[int, str] = {}
        self.batch_saved = {"inputs": 0, "targets": 0, "loss": 0}

    def _pack(self, tensor: Tensor) -> Tensor:
        address, nbytes = storage_key(tensor)
        if address in self.owned or not nbytes:
            return tensor
        kind = self.batch.get(address)
        if kind is not None:
            if (address, -1) not in self._counted:
                self.batch_saved[kind] += nbytes
                self._counted.add((address, -1))
            return tensor
        if self.current == len(self.layers):  # inside the loss
            if address not in self.first_layer:
                self.first_layer[address] = self.current
                self.batch_saved["loss"] += nbytes
            return tensor
        first = self.first_layer.setdefault(address, self.current)
        if first == self.current and (address, self.current) not in self._counted:
            self.saved[self.current] += nbytes
        elif first < self.current and (address, self.current) not in self._counted:
            self.input_saved[self.current] += nbytes
        self._counted.add((address, self.current))
        return tensor

    def run(self, inputs: Any, targets: Any, loss_fn, autocast) -> Any:
        """Forward and backward once, attributing saved storages; the model's outputs,
        detached (what ``_loss_live_peak`` measures the loss alone on)."""
        self._counted: set[tuple[int, int]] = set()
        for kind, value in (("inputs", inputs), ("targets", targets)):
            for tensor in tensors_in(value):
                self.batch[storage_key(tensor)[0]] = kind
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(self._entering(index), with_kwargs=True))
            handles.append(layer.register_forward_hook(self._leaving(index)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                with autocast:
                    outputs = call_model(self.model, inputs)
                    self.current = len(self.layers)
                    loss = loss_fn(outputs, targets)
            loss = _scalar(loss)
            params = [p for p in self.model.parameters() if p.requires_grad]
            if params and loss.requires_grad:
                torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return map_output_tensors(outputs, Tensor.detach)

    def _entering(self, index: int):
        def hook(module, args, kwargs):
            self.current = index
            value = (args, kwargs) if kwargs else args
            self.input_bytes[index] = _bytes(value)
            self.inputs[index] = (detached(args), detached(kwargs))

        return hook

    def _leaving(self, index: int):
        def hook(module, args, output):
            self.output_bytes[index] = _bytes(output)

        return hook


def fastest_seconds(run: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs of a fixed piece of work, after one untimed
    (first calls pay one-off allocations). On a machine other processes share, a run
    that one of them interrupts takes tens of times longer: ten AdamW steps of 65,536
    elements on one thread of a busy 2-core machine took 48, 1.4, 0.7, 26, 0.6, 0.4,
    0.4, 21, 0.5 and 0.4 ms, so that a median of three could land on 26 ms and put a
    phantom 0.1 s on a step of a 335 k-parameter model (issue 24). The fastest is the
    work's own cost on this machine."""
    return fastest_of_each((run,), repeats)[0]


def _pass_seconds(device: torch.device, autocast_of: Callable[[], Any]) -> float:
    """The fixed seconds of one pass, whatever its layers: half of a forward and a backward
    of a one-element stage as a pipeline stage runs them, each called on its own (its input
    a leaf that wants its gradient, as a received activation is; the forward under the
    run's autocast; the backward from the output's gradient). A layer list's lines hold
    the whole model's one pair of them in their shares; a stage pays it per pass."""

    def one_pass_pair() -> None:
        received = torch.ones(1, device=device, requires_grad=True)
        with torch.enable_grad(), autocast_of():
            output = received * 1.0
        torch.autograd.backward([output], [torch.ones_like(output)])

    return fastest_seconds(one_pass_pair, PASS_REPEATS) / 2


def _training_seconds(
    subject: nn.Module,
    sample: tuple[Any, Any],
    sizes: list[int],
    loss_fn: Callable[[Any, Any], Any],
    autocast_of: Callable[[torch.device], Any],
    repeats: int,
) -> dict[int, float]:
    """Per size, the fastest of a forward and backward of the whole model on that many
    samples, as an engine's micro-batch runs it: no hooks, and the gradients accumulated
    into buffers that already exist (a replica's buckets, a pipeline stage's later
    micro-batches), which costs a read and a write of every gradient per micro-batch (on
    the default mlp, 1024 wide, one thread: 5.3 ms at 8 samples against 3.6 ms for the
    same pass handing back new gradients). The model's own gradients are put back.

    The sizes are timed in turn, so that an interruption or a slow patch of the machine
    spoils one run of each rather than every run of one, and a short run more often: a
    size of ``1/k`` of the largest up to ``k`` times as often as the largest's
    ``repeats``, as far as ``TIMED_SECONDS`` of runs. On a quiet 2-core machine the
    fastest of 3 passes of that mlp at 8 samples, timed back to back, came out 6.9 to
    8.7 ms from one call to the next, and the fastest of 24 in turn 4.3 to 4.6 ms. A
    50 M-parameter gpt's passes (0.1-1 s) are timed ``repeats`` times each: timed ``k``
    times as often, they took the README's plan from 42 s of measuring to 77 s."""
    params = [p for p in subject.parameters() if p.requires_grad]
    device = next((p.device for p in params), torch.device("cpu"))
    kept = [p.grad for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)

    def run(size: int) -> None:
        inputs, targets = _first_of(sample, size)
        with autocast_of(device):
            loss = loss_fn(call_model(subject, inputs), targets)
        loss = _scalar(loss)
        if loss.requires_grad:
            loss.backward()

    largest = max(sizes)
    fastest = dict.fromkeys(sizes, float("inf"))
    try:
        runs = {}
        for size in sizes:  # untimed: one-off costs, and how long a run takes
            start = time.perf_counter()
            run(size)
            once = max(time.perf_counter() - start, 1e-6)
            runs[size] = min(repeats * largest // size, max(repeats, int(TIMED_SECONDS / once)))
        for turn in range(max(runs.values())):
            for size in sizes:
                if turn < runs[size]:
                    start = time.perf_counter()
                    run(size)
                    fastest[size] = min(fastest[size], time.perf_counter() - start)
        return fastest
    finally:
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad


def _timed_by_size(
    points: dict[int, dict[str, Any]], wholes: dict[int, float], small: int
) -> list[tuple[Curve, Curve]]:
    """Each layer's (forward and backward, forward) seconds as curves through every size
    the whole model was timed at: at the sizes traced (``points``) the layers' own shares,
    at the others (``TIMED_FRACTIONS``) the whole model's time shared as at ``small``."""
    count = len(points[small]["times"])
    whole_small = wholes[small] or 1.0
    curves = []
    for i in range(count):
        backward: dict[int, float] = {}
        forward: dict[int, float] = {}
        for size, whole in wholes.items():
            f, fb = (points.get(size) or points[small])["times"][i]
            scale = 1.0 if size in points else whole / whole_small
            forward[size], backward[size] = f * scale, fb * scale
        curves.append((Curve.through(backward), Curve.through(forward)))
    return curves


def _affordable_size(whole_run: Callable[[int], None], largest: int) -> int:
    """The largest micro-batch up to ``largest`` whose one forward and backward of the
    whole model takes at most ``SIZE_BUDGET_S`` (at least 2 where ``largest`` is, so that
    two sizes give a line): doubling from 2, each probe run once, the first call's
    one-off costs making it err small."""
    size = min(2, largest)
    while size < largest:
        start = time.perf_counter()
        whole_run(size)
        if 2 * (time.perf_counter() - start) > SIZE_BUDGET_S:
            break
        size = min(2 * size, largest)
    return size


def fastest_of_each(runs: tuple[Callable[[], Any], ...], repeats: int) -> list[float]:
    """``fastest_seconds`` of several pieces of work timed in turn, round by round, so
    that a difference between them is not a change of the machine's load between two
    separate timings."""
    for run in runs:
        run()
    seconds: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, times in zip(runs, seconds, strict=True):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return [min(times) for times in seconds]


def _layer_passes(
    layer: nn.Module, recorded: tuple[tuple, dict], autocast_of
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``layer``'s forward (with the graph built, as recompute runs it again in backward)
    and its forward and backward, on its recorded input made to need a gradient."""
    args, kwargs = recorded
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward() -> Any:
        with torch.enable_grad(), autocast_of():
            return layer(*fresh_leaves(args), **kwargs)

    def forward_backward() -> None:
        inputs = fresh_leaves(args)
        with torch.enable_grad(), autocast_of():
            out = layer(*inputs, **kwargs)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        sources = params + [t for t in tensors_in(inputs) if t.requires_grad]
        if outs and sources:
            torch.autograd.grad(
                outs, sources, [torch.ones_like(t) for t in outs], allow_unused=True
            )

    return forward, forward_backward


def _layer_times(layer: nn.Module, recorded: tuple[tuple, dict], autocast_of, repeats: int):
    """(forward seconds, forward and backward seconds) of ``layer`` on its recorded input."""
    forward, forward_backward = _layer_passes(layer, recorded, autocast_of)
    return fastest_seconds(forward, repeats), fastest_seconds(forward_backward, repeats)


def _layer_live_peak(
    layer: nn.Module, recorded: tuple[tuple, dict], autocast_of
) -> list[tuple[int, int]]:
    """Bytes live at the highest moments of ``layer``'s forward and backward alone on its
    recorded input (``LiveTensors``), its parameters and that input apart, as (bytes beyond
    the parameters' gradients, those gradients' bytes) per stretch of backward: what it
    saves, its output and the output's gradient, its operators' temporaries, its input's
    gradient, and its parameters' gradients. Run once, outside the timed runs (the count
    slows each operator).

    Why a layer with a floating input has its parameters' gradients added rather than
    measured: measured with them, the peak is the larger of a moment the activations
    dominate and one the gradients do, which is no line in the micro-batch (a block of the
    quick-start gpt peaks at 0.92 MB with 1 sample and 1.05 MB with 2, then at 5.8 MB with
    16, not the 2.9 MB the line through the first two gives). Backward to the input alone
    peaks in proportion to the micro-batch; the gradients, all of them at once, bound the
    rest (high by at most the layer's parameter bytes): one stretch. A layer with no
    floating input (an embedding; a whole model that is no layer list, fed token ids) is
    measured with its parameters' gradients, cut at each gradient's arrival into stretches
    whose gradients so far are fixed and whose rest grows with the micro-batch
    (``Envelope``: the whole model's gradients added at once would err high by all of
    them)."""
    args, kwargs = recorded
    params = [p for p in layer.parameters() if p.requires_grad]
    stretches: list[tuple[int, int]] = []
    made = 0
    with LiveTensors() as live:
        live.exclude([*layer.parameters(), *layer.buffers(), *tensors_in([args, kwargs])])
        a = fresh_leaves(args)
        with torch.enable_grad(), autocast_of():
            out = layer(*a, **kwargs)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        inputs = [t for t in tensors_in(a) if t.requires_grad]

        def arrived(grad: Tensor) -> None:
            nonlocal made
            stretches.append((live.peak - made, made))
            live.reset_peak()
            made += grad.numel() * grad.element_size()

        handles = [] if inputs else [p.register_hook(arrived) for p in params]
        try:
            if outs and (inputs or params):
                grads = torch.autograd.grad(
                    outs, inputs or params, [torch.ones_like(t) for t in outs], allow_unused=True
                )
                del grads
        finally:
            for handle in handles:
                handle.remove()
    if inputs:
        return [(live.peak, sum(p.numel() * p.element_size() for p in params))]
    return [*stretches, (live.peak - made, made)]


def _loss_live_peak(outputs: Any, targets: Any, loss_fn, autocast) -> int:
    """Bytes live at the highest moment of the loss's forward and backward alone on the
    model's ``outputs`` (fresh leaves of them: a worker's outputs, whose gradient the
    loss's backward makes), the outputs and targets themselves not counted
    (``ModelCosts.loss_transient``). The layers are each measured from their output's
    gradient, so this moment, the first of backward, is no layer's: with a vocabulary of
    8192 over 4096 tokens it was 120 MiB above every layer's (the live count's 733 MiB
    against 613 predicted)."""
    leaves = map_output_tensors(
        outputs,
        lambda t: t.detach().requires_grad_(t.is_floating_point()),
    )
    floating = [t for t in tensors_in(leaves) if t.requires_grad]
    with LiveTensors() as live:
        live.exclude([*tensors_in(outputs), *tensors_in(targets)])
        with torch.enable_grad(), autocast:
            loss = loss_fn(leaves, targets)
        loss = _scalar(loss)
        if floating and loss.requires_grad:
            grads = torch.autograd.grad(loss, floating, allow_unused=True)
            del grads
    return live.peak


def _split_copy(model: nn.Module, tensor: int, split_plan: dict[str, str] | None) -> nn.Module:
    """A copy of ``model`` holding what rank 0 of a tensor group of ``tensor`` holds."""
    split = copy.deepcopy(model)
    plan = resolve_plan(split, tensor, split_plan)
    apply_plan(split, plan, rank=0, tensor=tensor, group=mappings.LOCAL)
    return split


@contextmanager
def threads(count: int | None):
    """Intra-op threads for the block (None: as they are)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_model(
    model: nn.Module,
    sample: tuple[Any, Any],
    *,
    loss_fn: Callable[[Any, Any], Any],
    optimizer: OptimizerCost,
    precision: str = "fp32",
    tensor: int,
    split_plan: dict[str, str] | None = None,
    samples: int | None = None,
    repeats: int = REPEATS,
    worker_threads: int | None = None,
    pieces: bool = False,
) -> ModelCosts:
    """The ``ModelCosts`` of ``model`` (see the module docstring; one compiled whole, as
    written) at micro-batches of ``samples`` and half as many (``samples``: the sample's
    own size by default; smaller where one run there would exceed ``SIZE_BUDGET_S``);
    ``tensor`` is the degree a worker runs at (1: the whole model, no split); ``split_plan``
    names which layers split how; ``pieces``: per piece of a cut at every block."""
    inputs, targets = sample
    available = batch_size(inputs)
    model = as_written(model)  # compiled whole: hooks cannot run inside dynamo's graph
    parameters = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    subject = model if tensor == 1 else _split_copy(model, tensor, split_plan)
    listed = is_layer_list(subject)
    autocast_of = Precision.of(precision).autocast
    device = next((p.device for p in subject.parameters()), torch.device("cpu"))
    cut = _Cut.of(subject, listed, pieces, device)
    points: dict[int, dict[str, Any]] = {}
    with _untouched(subject), threads(worker_threads):

        def whole_run(size: int) -> None:
            _Trace(subject, []).run(
                _first(inputs, size), _first(targets, size), loss_fn, autocast_of(device)
            )

        large = _affordable_size(whole_run, min(samples or available, available))
        small = max(1, large // 2)
        timed_sizes = sorted({large, *(max(1, large // f) for f in TIMED_FRACTIONS)})
        wholes = _training_seconds(subject, sample, timed_sizes, loss_fn, autocast_of, repeats)
        for size in sorted({small, large}):
            micro = (_first(inputs, size), _first(targets, size))
            points[size] = _measure_point(
                subject, micro, loss_fn, lambda: autocast_of(device), repeats, cut
            )
            alone = sum(t[1] for t in points[size]["times"])
            if alone > 0:  # each layer's share of the whole model's forward and backward
                scale = wholes[size] / alone
                points[size]["times"] = [(f * scale, fb * scale) for f, fb in points[size]["times"]]
        pass_s = _pass_seconds(device, lambda: autocast_of(device))
    lo, hi = points[small], points[large]
    layer_times = _timed_by_size(points, wholes, small)

    def line(get: Callable[[dict], float]) -> Line:
        return Line.through((small, get(lo)), (large, get(hi)))

    def batch_line(kind: str) -> Line:
        return line(lambda p: p["trace"].batch_saved[kind])

    def envelope(i: int) -> Envelope:
        return _envelope((small, lo["live_peaks"][i]), (large, hi["live_peaks"][i]))

    costs = _layer_costs(cut, line, envelope, layer_times, _split_factors(cut, lo, hi))
    return ModelCosts(
        layers=tuple(costs),
        layer_list=listed,
        pieces=cut.container,
        tensor=tensor,
        precision=precision,
        parameters=parameters,
        optimizer=optimizer,
        tensor_messages=line(lambda p: p["messages"]),
        tensor_bytes=line(lambda p: p["bytes"]),
        inputs_saved=batch_line("inputs"),
        targets_saved=batch_line("targets"),
        loss_saved=batch_line("loss"),
        loss_transient=line(lambda p: p["loss_peak"]),
        **_structure(subject, cut),
        pass_s=pass_s,
    )


def _structure(subject: nn.Module, cut: _Cut) -> dict[str, Any]:
    """What the model is made of beside its layers' figures: ``ModelCosts.modules`` and
    ``ModelCosts.tied_layers``."""
    return {"modules": module_listing(subject), "tied_layers": _tied_layers(subject, cut)}


def _tied_layers(subject: nn.Module, cut: _Cut) -> tuple[tuple[int, ...], ...]:
    """``ModelCosts.tied_layers``: each Parameter's layers (of a cut at named blocks, its
    pieces as the engine's plan owns them), where it has more than one."""
    users: dict[int, set[int]] = {}
    if cut.runs is not None:
        owner = cut.runs.plan.owner
        for name, param in subject.named_parameters(remove_duplicate=False):
            users.setdefault(id(param), set()).add(owner[name])
    else:
        for index, layer in enumerate(cut.layers):
            for param in layer.parameters():
                users.setdefault(id(param), set()).add(index)
    return tuple(sorted(tuple(sorted(held)) for held in users.values() if len(held) > 1))


def module_listing(model: nn.Module) -> tuple[tuple[str, str, int, bool], ...]:
    """Each module's path, class name, the trainable bytes it holds itself (a shared
    parameter at its first holder) and whether it has a forward of its own (a ModuleList
    has none), in ``named_modules`` order (``ModelCosts.modules``)."""
    seen: set[int] = set()
    listing = []
    for path, module in model.named_modules():
        own = 0
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                own += param.numel() * param.element_size()
        called = type(module).forward is not nn.Module.forward
        listing.append((path, type(module).__name__, own, called))
    return tuple(listing)


def _measure_point(
    subject: nn.Module,
    micro: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], Any],
    autocast: Callable[[], Any],
    repeats: int,
    cut: _Cut,
) -> dict[str, Any]:
    """One micro-batch size's trace (what autograd saves, per layer), the loss's own live
    peak (``_loss_live_peak``), the split layers' messages and bytes, and each layer's
    (forward, forward+backward) seconds alone (each piece of a cut at named blocks as its
    stage runs it: ``_Cut.stand_ins``)."""
    layers = cut.layers
    trace = _Trace(subject, layers)
    calls_before, bytes_before = sum(mappings.CALLS.values()), sum(mappings.BYTES.values())
    outputs = trace.run(micro[0], micro[1], loss_fn, autocast())
    messages = sum(mappings.CALLS.values()) - calls_before
    payload = sum(mappings.BYTES.values()) - bytes_before
    timed: dict[tuple, tuple[float, float]] = {}  # each distinct block timed once
    measured_peaks: dict[tuple, int] = {}  # and its live peak measured once
    measured_kept: dict[tuple, int] = {}  # and what a split backward's B keeps
    measured_split: dict[tuple, float] = {}  # and what splitting it costs in time
    times, peaks, kept, split = [], [], [], []
    stand_ins = cut.stand_ins(trace.inputs, micro[0])
    for i, layer in enumerate(layers):
        layer, recorded = stand_ins.get(i, (layer, trace.inputs[i]))
        if recorded is None:
            times.append((0.0, 0.0))
            peaks.append([(0, 0)])
            kept.append(0)
            split.append(1.0)
            continue
        key = block_signature(layer, recorded)
        if key not in timed:
            timed[key] = _layer_times(layer, recorded, autocast, repeats)
            measured_peaks[key] = _layer_live_peak(layer, recorded, autocast)
            measured_kept[key] = _kept(layer, recorded, autocast) if cut.splits else 0
            measured_split[key] = (
                _split_ratio(layer, recorded, autocast, repeats) if cut.splits else 1.0
            )
        times.append(timed[key])
        peaks.append(measured_peaks[key])
        kept.append(measured_kept[key])
        split.append(measured_split[key])
    return {
        "trace": trace,
        "loss_peak": _loss_live_peak(outputs, micro[1], loss_fn, autocast()),
        "times": times,
        "messages": messages,
        "bytes": payload,
        "live_peaks": peaks,
        "kept": kept,
        "split": split,
    }


def _kept(layer: nn.Module, recorded: tuple[tuple, dict], autocast: Callable[[], Any]) -> int:
    """What a zero-bubble B keeps for ``layer``'s W: a layer's, or a piece's as its stage
    runs it (``PieceRun``)."""
    if isinstance(layer, PieceRun):
        return layer.kept_for_weight_pass(recorded, autocast)
    return kept_for_weight_pass(layer, recorded, autocast)


def _split_ratio(
    layer: nn.Module, recorded: tuple[tuple, dict], autocast: Callable[[], Any], repeats: int
) -> float:
    """How many times its plain forward and backward a zero-bubble stage's split backward
    of ``layer`` takes (its F, B and W, as the engine's ``LayerTape`` runs them; a piece's
    as its stage runs it), the two timed in turn (``fastest_of_each``): on the bench's
    layers 1.09-1.15x for a gpt block or a GPT-2 piece, 1.2-1.8x for a small linear layer
    or a norm. A ratio, not the seconds between them, so that it carries over to the
    micro-batch sizes below the two measured, where a line through two differences
    dipped under zero; and the two in turn, since two separate fastest-of-three timings
    of a ~10 ms piece differed by more than the split adds from one measurement to the
    next."""
    if isinstance(layer, PieceRun):
        passes = layer.split_pass(recorded, autocast)
    else:
        passes = split_layer_pass(layer, recorded, autocast)
    _, plain = _layer_passes(layer, recorded, autocast)
    with passes as triple:
        plain_s, split_s = fastest_of_each((plain, triple), repeats)
    return split_s / plain_s if plain_s > 0 else 1.0


def _split_factors(cut: _Cut, small: dict, large: dict) -> list[float | None]:
    """Each layer's ``LayerCost.split_factor``: the mean of its ratios at the two sizes,
    at least 1 (None where the model cannot run split)."""
    if not cut.splits:
        return [None] * len(cut.holders)
    pairs = zip(small["split"], large["split"], strict=True)
    return [max(1.0, (a + b) / 2) for a, b in pairs]


def block_signature(layer: nn.Module, recorded: tuple[tuple, dict]) -> tuple:
    """What a layer's time depends on: its class and ``repr`` (its sizes), its parameters'
    and buffers' shapes, dtypes and whether they train, and its input's shapes, dtypes and
    other arguments. Layers that share it (a transformer's blocks) take the same time, so
    one of them is timed for all: a gpt of n blocks costs one block's timing, not n."""

    def described(value: Any) -> Any:
        if isinstance(value, Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
        if isinstance(value, (tuple, list)):
            return tuple(described(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, described(v)) for k, v in sorted(value.items()))
        return repr(value)

    args, kwargs = recorded
    return (
        type(layer),
        repr(layer),
        tuple(
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters()
        ),
        tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers()),
        described(args),
        described(kwargs),
    )


def _layer_costs(
    cut: _Cut,
    line: Callable[[Callable[[dict], float]], Line],
    envelope: Callable[[int], Envelope],
    times: list[tuple[Curve, Curve]],
    split_factors: list[float | None],
) -> list[LayerCost]:
    """Each layer's ``LayerCost``: its parameters counted (a piece's those its stage
    holds, ``_Cut.holders``), its measured bytes as lines through the two micro-batch
    sizes (``line``), its live peak as their ``envelope``, its (forward and backward,
    forward) seconds as ``times`` gives them, and what splitting its backward costs
    (``split_factors``)."""
    costs = []
    for i, (layer, counted) in enumerate(cut.holders):
        trainable = [p for p in layer.parameters() if p.requires_grad]
        frozen = [p for p in layer.parameters() if not p.requires_grad]
        costs.append(
            LayerCost(
                name=cut.names[i],
                param_bytes=sum(p.numel() * p.element_size() for p in trainable),
                all_param_elements=counted,
                param_elements=sum(p.numel() for p in trainable),
                param_tensors=len(trainable),
                frozen_bytes=sum(t.numel() * t.element_size() for t in [*frozen, *layer.buffers()]),
                frozen_params=len(frozen),
                saved=line(lambda p, i=i: p["trace"].saved[i]),
                input_saved=line(lambda p, i=i: p["trace"].input_saved[i]),
                input_bytes=line(lambda p, i=i: p["trace"].input_bytes[i]),
                output_bytes=line(lambda p, i=i: p["trace"].output_bytes[i]),
                kept_bytes=line(lambda p, i=i: p["kept"][i]),
                split_factor=split_factors[i],
                time_s=times[i][0],
                forward_s=times[i][1],
                transient=envelope(i),
                largest_param_elements=max((p.numel() for p in trainable), default=0),
            )
        )
    return costs


def _envelope(
    small: tuple[int, list[tuple[int, int]]], large: tuple[int, list[tuple[int, int]]]
) -> Envelope:
    """Each stretch's bytes beyond the gradients as a line through the two sizes, its
    gradients (the same at both) added: the ``Envelope`` of ``_layer_live_peak``'s two
    measurements."""
    (x0, lo), (x1, hi) = small, large
    if x0 == x1:
        lo = hi
    if [g for _, g in lo] != [g for _, g in hi]:
        raise RuntimeError(
            "a layer's gradients arrived in another order at another micro-batch size, so "
            "its backward's stretches cannot be matched; report this model to paratrain."
        )
    lines = []
    for (y0, grads), (y1, _) in zip(lo, hi, strict=True):
        through = Line.through((x0, y0), (x1, y1))
        lines.append(Line(through.intercept + grads, through.slope))
    return Envelope(tuple(lines))


def _layer_name(model: nn.Module, layer: nn.Module, listed: bool) -> str:
    if not listed:
        return type(model).__name__
    for name, module in model.named_modules():
        if module is layer:
            return name
    return type(layer).__name__


@dataclass
class _Cut:
    """What the model is measured as: its layer list, the whole model as one layer, or
    (``pieces``) the pieces of the pipeline's cut before every block (``parallel/piece_runs``)."""

    layers: list[nn.Module]
    """The modules the trace books saved bytes to (hooked at their calls)."""
    names: list[str]
    holders: list[tuple[nn.Module, int]]
    """Per layer, the module holding its parameters and the count a cut balances it by."""
    splits: bool
    """Whether a split backward (zero-bubble) can run it: a layer list's or a cut's."""
    container: str = ""
    runs: PieceRuns | None = None

    @classmethod
    def of(cls, subject: nn.Module, listed: bool, pieces: bool, device: torch.device) -> _Cut:
        if listed or not pieces:
            layers = list(layer_list(subject)[0]) if listed else [subject]
            names = [_layer_name(subject, layer, listed) for layer in layers]
            counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
            return cls(layers, names, list(zip(layers, counts, strict=True)), listed)
        container = automatic_container(subject)
        if container is None:
            raise ValueError(
                f"{type(subject).__name__} has no ModuleList or nn.Sequential of blocks, so "
                "it cannot be cut into stages at named blocks; its layouts that need that "
                "have no costs."
            )
        runs = PieceRuns(subject, container, device)
        names = [f"{container}.{index}" for index in range(len(runs.blocks))]
        return cls(runs.blocks, names, runs.holders(), True, container, runs)

    def stand_ins(self, recorded: list[Any], inputs: Any) -> dict[int, tuple[nn.Module, Any]]:
        """What each layer is measured as, and on, where that is not the layer on its
        recorded input: every piece's run (``PieceRuns.stand_ins``); none without pieces."""
        return {} if self.runs is None else self.runs.stand_ins(recorded, inputs)


def measure_optimizer(
    factory: Callable, *, repeats: int = OPTIMIZER_REPEATS, worker_threads: int | None = None
) -> OptimizerCost:
    """The state bytes per element and per tensor of the optimizer ``factory`` builds, and
    its step's seconds per element, from two probe parameters of different sizes.

    The step is timed with a worker's intra-op threads (``worker_threads``), as the model
    is: with the planning process's own (every core) on a machine whose cores are busy,
    the probe once took 1e-6 s per element against 9e-9 with a worker's one thread, and
    the planner added a phantom 0.3 s to every step of a data-parallel mlp."""
    with threads(worker_threads):
        return _measure_optimizer(factory, repeats)


def _step_temporaries(optimizer: torch.optim.Optimizer, params: tuple[Tensor, ...]) -> int:
    """Bytes a step of ``optimizer`` (which has stepped: its state exists) makes and frees
    again, at its highest (``LiveTensors``)."""
    with LiveTensors() as live:
        live.exclude([*params, *(p.grad for p in params if p.grad is not None)])
        live.exclude(
            v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
        )
        optimizer.step()
    return live.peak


def _fused_step_temporaries(factory: Callable) -> int:
    """``_step_temporaries`` of the optimizer as dp, ZeRO and the pipeline run it
    (``fused_optim``: the fused CPU kernel where it computes the same update)."""
    big, small = nn.Parameter(torch.zeros(1 << 16)), nn.Parameter(torch.zeros(16))
    optimizer = with_fused_kernel(optimizer_from_factory(factory, [("b", big), ("s", small)]))
    for param in (big, small):
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()
    return _step_temporaries(optimizer, (big, small))


def _measure_optimizer(factory: Callable, repeats: int) -> OptimizerCost:
    big, small = nn.Parameter(torch.zeros(1 << 16)), nn.Parameter(torch.zeros(16))
    named = [("probe.big", big), ("probe.small", small)]
    optimizer = optimizer_from_factory(factory, named)
    for param in (big, small):
        param.grad = torch.full_like(param, 1e-3)

    def step() -> None:
        optimizer.step()

    seconds = fastest_seconds(step, repeats)
    per_param = []
    for param in (big, small):
        state = optimizer.state.get(param, {})
        per_param.append(sum(storage_key(v)[1] for v in state.values() if isinstance(v, Tensor)))
    (large_bytes, small_bytes), (n_big, n_small) = per_param, (big.numel(), small.numel())
    per_element = (large_bytes - small_bytes) / (n_big - n_small)
    per_tensor = max(0.0, large_bytes - per_element * n_big)
    return OptimizerCost(
        bytes_per_element=per_element,
        bytes_per_tensor=per_tensor,
        step_s_per_element=seconds / (n_big + n_small),
        name=type(optimizer).__name__,
        temporary_bytes_per_element=_step_temporaries(optimizer, (big, small)) / n_big,
        fused_temporary_bytes_per_element=_fused_step_temporaries(factory) / n_big,
    )
