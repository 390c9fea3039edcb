"""What the planner measures and what a strategy predicts from it: pure data and arithmetic.

The planner (``paratrain/planner``) measures a model once per precision and tensor degree
(``ModelCosts``: per layer, its parameter bytes, the bytes autograd saves and the seconds
forward and backward take, each as a line in the micro-batch size) and this machine's
collectives once (``MachineCosts``); each strategy then predicts, without running
anything, what one worker of a layout holds and how long a step takes (``Prediction``),
in its own ``cost.py``. So a candidate costs microseconds to evaluate and the planner
can print every one of them.

The memory a prediction gives is the ledger's (``runtime/ledger``): parameters, gradients,
optimizer state, activations saved for backward and communication buffers, as the engine
books them at its metering points, at the step on which the total peaks (a run's second
step on: the optimizer state exists from the first step's end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication")


@dataclass(frozen=True)
class Line:
    """``intercept + slope * samples``: a cost measured at two micro-batch sizes."""

    intercept: float
    slope: float

    def at(self, samples: float) -> float:
        return max(0.0, self.intercept + self.slope * samples)

    def __add__(self, other: Line) -> Line:
        return Line(self.intercept + other.intercept, self.slope + other.slope)

    @classmethod
    def zero(cls) -> Line:
        return cls(0.0, 0.0)

    @classmethod
    def through(cls, small: tuple[float, float], large: tuple[float, float]) -> Line:
        """The line through (samples, value) ``small`` and ``large``; a flat one at
        ``large``'s value where they share a size."""
        (x0, y0), (x1, y1) = small, large
        if x1 == x0:
            return cls(y1, 0.0)
        slope = (y1 - y0) / (x1 - x0)
        return cls(y1 - slope * x1, slope)


@dataclass(frozen=True)
class Curve:
    """Seconds measured at several micro-batch sizes, joined by straight segments (the
    first and last extended beyond the sizes measured). A line through two sizes does
    not hold a layer's time: at small micro-batches its weights are read, and their
    gradients allocated and accumulated, once per micro-batch whatever its samples, so the
    time stops falling with them. The default mlp (1024 wide) on one thread took 11.4 ms
    at 64 samples, 6.9 at 32 and 5.3 at 8, where the line through 32 and 64 gives 3.5:
    a 2-stage pipeline of 8 micro-batches was predicted at 0.41 of its measured step."""

    points: tuple[tuple[float, float], ...]
    """(samples, seconds), by samples."""

    def at(self, samples: float) -> float:
        points = self.points
        if len(points) == 1:
            return max(0.0, points[0][1])
        segment = next(
            (pair for pair in zip(points, points[1:], strict=False) if samples <= pair[1][0]),
            (points[-2], points[-1]),
        )
        (x0, y0), (x1, y1) = segment
        return max(0.0, y0 + (y1 - y0) * (samples - x0) / (x1 - x0))

    @classmethod
    def through(cls, points: dict[int, float]) -> Curve:
        return cls(tuple(sorted((float(x), float(y)) for x, y in points.items())))


@dataclass(frozen=True)
class Envelope:
    """The highest of several lines: a peak that moves between moments as the micro-batch
    grows. A whole model measured with its parameters' gradients peaks early in backward
    (activations, growing with the samples) or late (every gradient, fixed), so no one
    line through two small sizes holds it: Hugging Face GPT-2 measured at 1 and 2 samples
    read a flat line and came out 7.3% under its live peak at 8. Each line is one stretch
    of backward between two gradients' arrivals, measured at both sizes."""

    lines: tuple[Line, ...]

    def at(self, samples: float) -> float:
        return max((line.at(samples) for line in self.lines), default=0.0)

    @classmethod
    def of(cls, line: Line) -> Envelope:
        return cls((line,))


def total(lines: list[Line]) -> Line:
    out = Line.zero()
    for line in lines:
        out = out + line
    return out


@dataclass(frozen=True)
class LayerCost:
    """One layer of a layer list (or the whole model where it is none), as one worker of
    the measured tensor degree holds and runs it."""

    name: str
    param_bytes: int
    """Bytes of its trainable parameters this worker holds (its slices where split)."""
    all_param_elements: int
    """Elements of all its parameters, frozen ones too (what the pipeline balances by)."""
    param_elements: int
    param_tensors: int
    frozen_bytes: int
    """Parameters that do not train (no gradient, no optimizer state), and buffers."""
    frozen_params: int
    """How many parameters that do not train it has (a recompute segment starts at any
    layer with parameters)."""
    saved: Line
    """Bytes autograd saves in its forward that no earlier layer saved."""
    input_saved: Line
    """Bytes of saved storages an earlier layer made (its input): a stage starting here
    holds its own received copy of them."""
    input_bytes: Line
    """Bytes of its input: what a recompute segment starting here keeps."""
    output_bytes: Line
    """Bytes of its output: what crosses a stage boundary after it."""
    time_s: Line | Curve
    """Seconds of its forward and backward (a ``Curve`` where measured at several sizes)."""
    forward_s: Line | Curve
    """Seconds of its forward alone (recompute runs it twice)."""
    transient: Envelope = field(default_factory=lambda: Envelope.of(Line.zero()))
    """Bytes live at the highest moment of its forward and backward run alone, its
    parameters and input apart (``LiveTensors``): its saved tensors, output, the output's
    gradient, operator temporaries, and its input's and parameters' gradients."""
    largest_param_elements: int = 0
    """Elements of its largest trainable tensor (an optimizer step's temporaries scale
    with the tensor it is at)."""
    kept_bytes: Line | None = None
    """Bytes a split backward's B leaves alive for the layer's W when its input carries a
    gradient (the gradients it keeps: each parameter-owning module's outputs' where W
    takes them unit by unit, ``pipeline/weight_units``), measured; None where not
    measured (the output's gradient is then assumed)."""
    split_factor: float | None = None
    """How many times ``time_s`` a zero-bubble stage's split backward of the layer takes
    where its input carries a gradient (F recording the parameter-owning modules' calls,
    B to the input and their outputs keeping the graph, W walking it module by module:
    the engine's ``LayerTape``), measured alone beside its plain forward and backward
    (``split_backward_time``), at least 1; None where not measured (taken as 1)."""


@dataclass(frozen=True)
class OptimizerCost:
    """The user's optimizer, measured: state bytes per element and per parameter tensor
    (Adam: 8 per element, a 4-byte step per tensor; SGD with momentum: 4 per element),
    and seconds of one step per parameter element."""

    bytes_per_element: float
    bytes_per_tensor: float
    step_s_per_element: float
    name: str = "optimizer"
    temporary_bytes_per_element: float = 0.0
    """Bytes a step makes and frees again, per element of the largest tensor it updates
    (PyTorch's per-tensor Adam: ``sqrt`` and a quotient, 8 bytes per fp32 element; a
    ``foreach`` optimizer makes them for every tensor at once, which this probe of one
    large tensor and one small one also reads as the large one's)."""
    fused_temporary_bytes_per_element: float = 0.0
    """The same for the optimizer as dp and the pipeline rebuild it with the fused CPU
    kernel (``fused_optim``), which updates in place: none for Adam."""

    def state_bytes(self, elements: float, tensors: float) -> float:
        return self.bytes_per_element * elements + self.bytes_per_tensor * tensors


@dataclass(frozen=True)
class ModelCosts:
    """A model measured at one precision and tensor degree (``tensor`` 1: unsplit)."""

    layers: tuple[LayerCost, ...]
    layer_list: bool
    """Whether ``layers`` are the model's layer list (else one entry, the whole model, or
    the pieces of a cut at named blocks: ``pieces``)."""
    tensor: int
    precision: str
    parameters: int
    """Elements of the whole (unsplit) model's parameters."""
    optimizer: OptimizerCost
    tensor_messages: Line = field(default_factory=Line.zero)
    """All-reduces a worker's tensor group makes per micro-batch (count)."""
    tensor_bytes: Line = field(default_factory=Line.zero)
    """Their payload bytes per micro-batch."""
    inputs_saved: Line = field(default_factory=Line.zero)
    """Bytes of the batch's inputs the first layer saves (token ids, features), as a line
    in the samples of the tensor they belong to (see ``batch_storage``)."""
    targets_saved: Line = field(default_factory=Line.zero)
    """Bytes of the targets the loss saves, likewise."""
    loss_saved: Line = field(default_factory=Line.zero)
    """Bytes the loss saves of its own (log-probabilities), in the micro-batch's samples."""
    loss_transient: Line = field(default_factory=Line.zero)
    """Bytes live at the highest moment of the loss's forward and backward alone on the
    model's outputs, those outputs not counted: what it saves, its output gradient's chain
    (cross-entropy: the log-probabilities, their gradient and the logits' gradient, three
    logits-sized tensors at once), in the micro-batch's samples. The moment a worker that
    computes the loss holds it is backward's first (``live_cost.backward_peak``)."""
    pass_s: float = 0.0
    """Seconds of the fixed work of one pass called on its own (a forward, or a backward
    from its output's gradient), whatever its layers hold: measured on a one-element pass
    (``measure._pass_seconds``). The whole model's one forward and backward pays it twice,
    held in the layers' lines (scaled to add up to the whole model); a pipeline stage pays
    it on each of its passes of each micro-batch (``pipeline/cost.pass_overhead``)."""
    pieces: str = ""
    """Where not empty, ``layers`` are the pieces of the pipeline's cut of a model that is
    no layer list before every block of this container (``parallel/piece_runs``): the first
    holding what comes before the blocks, the last what comes after."""
    modules: tuple[tuple[str, str, int, bool], ...] = ()
    """Every module as (its ``named_modules`` path, its class name, the bytes of the
    trainable parameters it holds itself, a tied one at its first holder, whether it has a
    forward of its own): what a strategy
    that cuts the model at modules of its own choosing (zero3's units) sizes them from."""
    tied_layers: tuple[tuple[int, ...], ...] = ()
    """Each Parameter that more than one of ``layers`` uses (an output head tied to the
    embedding), as those layers' indexes: where one spans pipeline stages, the stages sum
    its gradient at every step's end, so the steps end together (``pipeline/cost``)."""

    def param_bytes(self, layers: range | None = None) -> int:
        return sum(layer.param_bytes for layer in self._pick(layers))

    def _pick(self, layers: range | None) -> tuple[LayerCost, ...]:
        return self.layers if layers is None else tuple(self.layers[i] for i in layers)

    def elements(self, layers: range | None = None) -> int:
        return sum(layer.param_elements for layer in self._pick(layers))

    def tensors(self, layers: range | None = None) -> int:
        return sum(layer.param_tensors for layer in self._pick(layers))

    def frozen_bytes(self, layers: range | None = None) -> int:
        return sum(layer.frozen_bytes for layer in self._pick(layers))

    def optimizer_bytes(self, layers: range | None = None, share: float = 1.0) -> float:
        return self.optimizer.state_bytes(self.elements(layers) * share, self.tensors(layers))

    def time(self, samples: float, layers: range | None = None) -> float:
        return sum(layer.time_s.at(samples) for layer in self._pick(layers))

    def forward_time(self, samples: float, layers: range | None = None) -> float:
        return sum(layer.forward_s.at(samples) for layer in self._pick(layers))

    def split_extra_time(self, samples: float, layers: range | None = None) -> float:
        """What splitting their backward adds to the layers' ``time``."""
        return sum(
            (layer.split_factor - 1.0) * layer.time_s.at(samples)
            for layer in self._pick(layers)
            if layer.split_factor is not None
        )

    def saved(
        self,
        samples: float,
        layers: range | None = None,
        *,
        batch_samples: float | None = None,
    ) -> float:
        """Activation bytes one micro-batch of ``samples`` leaves saved in ``layers`` (all
        by default): their own, what the first of them saves of its input where an earlier
        layer made it, and the batch's own tensors the first and last layers save, at
        ``batch_samples`` (the storage they are views of; ``samples`` by default)."""
        picked = range(len(self.layers)) if layers is None else layers
        if not len(picked):
            return 0.0
        batch = samples if batch_samples is None else batch_samples
        own = sum(self.layers[i].saved.at(samples) for i in picked)
        total_bytes = own + self.layers[picked[0]].input_saved.at(samples)
        if picked[0] == 0:
            total_bytes += self.inputs_saved.at(batch)
        if picked[-1] == len(self.layers) - 1:
            total_bytes += self.targets_saved.at(batch) + self.loss_saved.at(samples)
        return total_bytes

    def recomputed_saved(
        self,
        samples: float,
        layers: range | None = None,
        *,
        batch_samples: float | None = None,
        one_segment: bool = False,
    ) -> float:
        """What a recomputed run keeps of one micro-batch in ``layers``: the input of each
        segment (``recompute``: each layer with parameters starts one; a pipeline stage is
        ``one_segment``, its input alone), and the loss's saved tensors and targets."""
        picked = range(len(self.layers)) if layers is None else layers
        if not len(picked):
            return 0.0
        batch = samples if batch_samples is None else batch_samples
        kept = 0.0
        for i in picked:
            layer = self.layers[i]
            starts = i == picked[0] or (
                not one_segment and (layer.param_bytes or layer.frozen_params)
            )
            if starts:
                kept += self.inputs_saved.at(batch) if i == 0 else layer.input_bytes.at(samples)
        if picked[-1] == len(self.layers) - 1:
            kept += self.targets_saved.at(batch) + self.loss_saved.at(samples)
        return kept


@dataclass(frozen=True)
class MachineCosts:
    """This machine's collectives over ``backend``, measured with local workers."""

    cores: int
    backend: str
    all_reduce: dict[int, Line]
    """Group size -> seconds of one all-reduce as a line in its payload bytes."""
    send: Line
    """Seconds of one point-to-point message to a worker waiting for it (woken by it), as
    a line in its bytes."""
    reduce_scatter: dict[int, Line] = field(default_factory=dict)
    """Likewise for a reduce-scatter (payload: the whole buffer each member hands over)."""
    all_gather: dict[int, Line] = field(default_factory=dict)
    """Likewise for an all-gather (payload: the whole buffer each member ends up with)."""
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    """Strategy name -> its own runtime's figures (``Strategy.machine_figures``)."""

    def figure(self, strategy: str, name: str) -> float:
        """One of ``strategy``'s figures; 0 where not measured (one worker, an old file)."""
        return self.figures.get(strategy, {}).get(name, 0.0)

    def all_reduce_s(self, payload_bytes: float, group: int, messages: float = 1.0) -> float:
        """Seconds of ``messages`` all-reduces of ``payload_bytes`` in all over ``group``."""
        return self._seconds(self.all_reduce, payload_bytes, group, messages)

    def reduce_scatter_s(self, payload_bytes: float, group: int, messages: float = 1.0) -> float:
        """ZeRO's gradient collective; a machine file without it falls back on all-reduce."""
        return self._seconds(self.reduce_scatter or self.all_reduce, payload_bytes, group, messages)

    def all_gather_s(self, payload_bytes: float, group: int, messages: float = 1.0) -> float:
        """ZeRO's parameter collective; a machine file without it falls back on all-reduce."""
        return self._seconds(self.all_gather or self.all_reduce, payload_bytes, group, messages)

    @staticmethod
    def _seconds(lines: dict[int, Line], payload: float, group: int, messages: float) -> float:
        if group <= 1 or messages <= 0 or not lines:
            return 0.0
        line = lines.get(group) or _nearest(lines, group)
        return messages * line.intercept + line.slope * payload

    def compute_seconds(self, total_work_s: float, critical_s: float) -> float:
        """A step's compute where the workers' work adds up to ``total_work_s`` (at one
        worker's speed) and its longest chain of dependent work is ``critical_s``: the
        cores run at most ``cores`` workers at once, so the step takes at least the work
        spread over them, and at least the chain (a pipeline's stages idle in its bubble,
        leaving their cores to others)."""
        return max(total_work_s / max(1, self.cores), critical_s)


def _nearest(lines: dict[int, Line], group: int) -> Line:
    """A group size not measured: the measured one nearest, its time scaled by the ring
    factor 2(n-1)/n per byte and log2(n) per message."""
    size = min(lines, key=lambda n: abs(math.log2(n) - math.log2(group)))
    line = lines[size]
    per_byte = (2 * (group - 1) / group) / (2 * (size - 1) / size)
    return Line(line.intercept * math.log2(group) / math.log2(size), line.slope * per_byte)


@dataclass(frozen=True)
class Run:
    """The run a layout is asked to fit: fixed by the caller."""

    devices: int
    global_batch: int
    gradient_accumulation: int = 1
    precision: str = "fp32"
    budget: int | None = None


@dataclass(frozen=True)
class Prediction:
    """One worker of a layout: the ledger at its peak (the worker that peaks highest), and
    the seconds of an optimizer step."""

    memory: dict[str, int]
    step_s: float
    notes: tuple[str, ...] = ()
    compute_s: float = 0.0
    communication_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values())

    @classmethod
    def of(
        cls,
        memory: dict[str, int],
        *,
        compute_s: float,
        communication_s: float,
        workers: int,
        machine: MachineCosts,
        notes: tuple[str, ...] = (),
    ) -> Prediction:
        """A step of ``compute_s`` then ``communication_s`` seconds; the note that compute
        is time-shared where ``workers`` outnumber the machine's cores comes first."""
        shared = (f"{workers} workers share {machine.cores} cores",)
        return cls(
            memory=memory,
            step_s=compute_s + communication_s,
            notes=(shared if workers > machine.cores else ()) + notes,
            compute_s=compute_s,
            communication_s=communication_s,
        )


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def with_recompute(layouts: list[dict], layer_list: bool) -> list[dict]:
    """Each layout as it is and, for a layer list, with ``recompute=True`` too."""
    if not layer_list:
        return layouts
    return [variant for layout in layouts for variant in (layout, {**layout, "recompute": True})]


def ledger_at_peak(
    *,
    parameters: float,
    gradients: float,
    optimizer: float,
    activations: float,
    communication: float = 0.0,
    gradients_persist: bool,
    communication_at_end: float = 0.0,
) -> dict[str, int]:
    """The categories at the moment the ledger's total peaks.

    The ledger books activations after each forward and the model state at each step's
    start and end. Gradients kept in buckets or flat shards (engines that reduce them)
    are there during forward; gradients set to None at each step's start are not, and
    come back only at its end, when the activations are gone. So the peak is the larger
    of the two moments.
    """
    base = {"parameters": parameters, "optimizer": optimizer}
    during = {
        **base,
        "gradients": gradients if gradients_persist else 0.0,
        "activations": activations,
        "communication": communication,
    }
    after = {
        **base,
        "gradients": gradients,
        "activations": 0.0,
        "communication": communication_at_end,
    }
    chosen = during if sum(during.values()) >= sum(after.values()) else after
    return {category: int(round(chosen[category])) for category in CATEGORIES}
