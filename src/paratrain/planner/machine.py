"""This machine's collectives, measured once and cached: what a message of n bytes costs.

The planner's step times add communication to compute, so it needs the latency and the
bandwidth of the backend the workers use (gloo over loopback on CPU, NCCL on GPUs), for
each group size a plan forms. ``measure_collectives`` times all-reduces, reduce-scatters
and all-gathers of a small and a large payload on groups of each size, and
point-to-point messages between two workers, inside a job (every worker calls it), each
after every member's share of compute, as a training step meets it (``after_work``);
``machine_costs`` starts the workers for that when it is called outside one (three
times where each worker has a core of its own, keeping the middle launch:
``launches``, ``middle_launch``), and keeps the result in a JSON file per machine,
backend and worker count (``~/.cache/paratrain/machine``; ``PARATRAIN_CACHE`` moves
it), so later plans take no measurement at all (``refresh=True`` measures again)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.parallel.cost_model import Line, MachineCosts, divisors
from paratrain.parallel.registry import strategy_class, strategy_names
from paratrain.runtime import comm
from paratrain.runtime.devices import current_device

SIZES = (4 * 1024, 4 * 1024 * 1024)
"""Payload bytes timed: a latency-bound and a bandwidth-bound message."""
REPEATS = 12
LAUNCHES = 3
"""Launches of the workers the collectives are timed in when the planner starts them and
each worker has a core of its own, the middle one kept (``middle_launch``, ``launches``)."""
FORMAT = 8
"""8: the middle of ``launches`` launches (7 and before: one launch); 7: a schedule
runner's seconds per micro-batch under a split backward too; 6: each strategy's own
figures (``Strategy.machine_figures``: a schedule runner's seconds per micro-batch), and
a collective's lower quartile of 12 repetitions (``after_work``) where 5 kept the
fastest of 7; 5: a point-to-point message timed as half a round trip to a waiting worker
(4: with the receiver busy until the message had arrived, which timed almost nothing);
4: collectives timed after each member's work, as a step calls them (3: their median; 2:
back to back)."""
WORK_MATMULS = 32
"""Products of two 128 x 128 matrices each member computes before every timed collective
(about a millisecond on one thread): see ``after_work``."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _slowest(seconds: float) -> float:
    """The slowest worker's time: a collective ends when its last member is done."""
    out = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0])


def after_work(
    run: Callable[[], Any],
    work: Callable[[], Any],
    *,
    member: bool,
    line_up: Callable[[], Any] = dist.barrier,
    post: Callable[[], Any] | None = None,
) -> float:
    """The seconds of ``run()`` (a collective) as a training step meets it: each member
    first does its share of compute (``work``), then calls it; the lower quartile of
    ``REPEATS`` repetitions. Not their median: on a machine other processes share, a
    repetition one of them interrupts takes many times longer (medians of 7 taken at a
    load average of 19 on 2 cores gave a 4 KiB all-reduce 7 ms and a message 20 ms, and
    a 2-stage pipeline predicted 4x slower than it ran), and a cached figure outlives the
    moment's load. Not the fastest either, which format 5 kept: on the same machine,
    quiet, 15 repetitions of a 4 KiB all-reduce after work took 0.5 ms at the fastest,
    0.8-1.4 at the lower quartile and 1.9-2.7 ms at the median, and a step pays what its
    collectives typically take: zero1 and zero2 on the mlp of ``bench_planner``'s first
    scenario ran at 1.6-1.9x their predicted steps, zero3 on Hugging Face GPT-2 at 2x.

    Timed back to back, a collective finds every member already waiting in it: gloo's
    all-reduce of 4 KiB took 0.19 ms on 2 cores. After work, the members arrive when
    their compute ends and the one waiting must be woken: the same collective took about
    1 ms on the same (busy) machine, and that is what each of a split layer's all-reduces
    costs a step (timed back to back, the planner chose tensor parallelism for an mlp on
    2 workers, predicting 2.4 ms per step, measured 10.2 ms, against 7.6 ms measured for
    data parallelism: issue 24). Every worker of the job calls it (``member``: whether
    this one takes part); ``line_up`` (a barrier) starts each repetition together;
    ``post`` runs before the work (a receive posted ahead)."""
    seconds = []
    for _ in range(1 + REPEATS):  # the first untimed: one-off costs
        line_up()
        if not member:
            continue
        if post is not None:
            post()
        work()
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return _lower_quartile(seconds[1:]) if seconds else 0.0


def member_work(device: torch.device) -> Callable[[], None]:
    """About a millisecond of compute on one thread (``WORK_MATMULS`` products), ended
    before it returns (a GPU's queue too)."""
    matrix = torch.randn(128, 128, device=device) / 128

    def work() -> None:
        result = matrix
        for _ in range(WORK_MATMULS):
            result = torch.tanh(result @ matrix)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return work


def measure_collectives() -> MachineCosts:
    """Every worker of the job calls it; every worker gets the same figures."""
    world, rank = comm.world_size(), comm.rank()
    device = current_device()
    work = member_work(device)
    kinds: dict[str, dict[int, Line]] = {"all_reduce": {}, "reduce_scatter": {}, "all_gather": {}}
    for size in (g for g in divisors(world) if g >= 2):
        group = None if size == world else dist.new_group(list(range(size)))
        for kind, lines in kinds.items():
            points = []
            for nbytes in SIZES:
                run = _collective(kind, nbytes, size, group, device)
                points.append((nbytes, _slowest(after_work(run, work, member=rank < size))))
            lines[size] = Line.through(points[0], points[1])
    send_points = []
    for nbytes in SIZES:
        hop = _Hop(torch.zeros(nbytes // 4, device=device), rank)
        seconds = after_work(hop.run, work if rank == 0 else _idle, member=rank < 2, post=hop.post)
        send_points.append((nbytes, _from_first(seconds / 2)))
    dist.barrier()
    figures = {name: strategy_class(name).machine_figures() for name in strategy_names()}
    return MachineCosts(
        cores=cores(),
        backend=dist.get_backend(),
        all_reduce=kinds["all_reduce"],
        send=_rising(Line.through(send_points[0], send_points[1])),
        reduce_scatter=kinds["reduce_scatter"],
        all_gather=kinds["all_gather"],
        figures={name: values for name, values in figures.items() if values},
    )


class _Hop:
    """A message to a worker that waits for it, and its reply: what a pipeline's fill and
    drain wait for (a stage idle until its neighbour's activation or gradient arrives,
    ``pipeline/cost``). Worker 0 works, then sends and waits for the reply; worker 1,
    idle with its receive posted (``post``), sends the payload back as soon as it arrives.
    Half the round trip is one message to a waiting worker, each wake-up included, timed
    on worker 0's clock alone. Timed with the receiver still busy when the message
    arrived (the probe before format 5), gloo's 4 KiB message took 0.12 ms on 2 cores at
    load 3, and a round trip like this one 6 ms, at load 15: a 2-stage pipeline of the
    default mlp was predicted at 3.0 ms per step and ran at 4.9-17 ms."""

    def __init__(self, payload: torch.Tensor, rank: int) -> None:
        self.payload, self.rank = payload, rank
        self.inbox = torch.empty_like(payload)  # worker 0 receives while its send may run
        self.received: Any = None

    def post(self) -> None:
        if self.rank in (0, 1):
            self.received = dist.irecv(self.inbox, src=1 - self.rank)

    def run(self) -> None:
        if self.rank == 0:
            dist.isend(self.payload, dst=1).wait()
            self.received.wait()
        elif self.rank == 1:
            self.received.wait()
            dist.isend(self.inbox, dst=0).wait()


def _idle() -> None:
    """The receiver's share of work before a hop: none (it waits for its neighbour)."""


def _from_first(seconds: float) -> float:
    """Worker 0's figure, on every worker (the others' include waiting for its work)."""
    out = torch.tensor([seconds], dtype=torch.float64)
    dist.broadcast(out, src=0)
    return float(out[0])


def _rising(line: Line) -> Line:
    """A message line whose bytes cost nothing or more: the fastest of a few runs of a
    large payload can come out under a small one's on a busy machine (each is a lower
    bound), and a message cannot cost less for more bytes; a flat line then, at the
    larger of the two figures."""
    if line.slope >= 0:
        return line
    return Line(line.intercept + line.slope * SIZES[0], 0.0)


def _collective(kind: str, nbytes: int, size: int, group, device: torch.device):
    """One collective of ``nbytes`` in all over a group of ``size``, as the engines call it."""
    whole = torch.zeros(nbytes // 4 // size * size, device=device)
    part = torch.zeros(whole.numel() // size, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter_sum(part, whole, group=group)
    return lambda: comm.all_gather_flat(whole, part, group=group)


def _measure_worker() -> dict:
    return to_json(measure_collectives())


def launches(devices: int) -> int:
    """How many launches to time the collectives in: ``LAUNCHES`` where every worker has a
    core of its own, so that where the scheduler places them decides (``middle_launch``);
    one where they outnumber the cores, which time-slices every collective in any launch
    (on 2 cores, the 4 KiB all-reduce over 8 workers was 17-26 ms in five launches and
    over 4 workers 5.0-8.2 ms in three: a spread of 1.5x, not several times) and where a
    launch takes longest (8 workers: 24 s; three took the README's first plan from 94 s
    to 140 s)."""
    return LAUNCHES if devices <= cores() else 1


def middle_launch(measured: list[dict]) -> dict:
    """Of several launches' figures (``to_json``), the launch whose small all-reduce over
    the most workers is the median, kept whole. The launch, not the repetition, is what
    varies most: on 2 idle cores the lower quartile of a 4 KiB all-reduce after work was
    0.3-0.7 ms in most launches of the same two workers and 1.2-4.4 ms in a third of them
    (12 launches; one slow launch held 2.8-4.4 ms over 72 repetitions), as the scheduler
    placed the two processes; one launch's figure, cached for every later plan, priced
    the same tensor-parallel layout's collectives 1.8-5.3 ms in five plans and once put
    its step at 3.2x its fastest. Steps pay the usual launch's cost, so the middle of
    three; one launch's figures are kept together, as measured with each other."""

    def small_all_reduce(data: dict) -> float:  # every launch has 2 or more workers
        lines = from_json(data).all_reduce
        return lines[max(lines)].at(SIZES[0])

    ordered = sorted(measured, key=small_all_reduce)
    return ordered[(len(ordered) - 1) // 2]


def to_json(machine: MachineCosts) -> dict:
    return {
        "format": FORMAT,
        "cores": machine.cores,
        "backend": machine.backend,
        **{
            kind: {str(k): [v.intercept, v.slope] for k, v in getattr(machine, kind).items()}
            for kind in ("all_reduce", "reduce_scatter", "all_gather")
        },
        "send": [machine.send.intercept, machine.send.slope],
        "figures": machine.figures,
    }


def from_json(data: dict) -> MachineCosts:
    def lines(kind: str) -> dict[int, Line]:
        return {int(k): Line(*map(float, v)) for k, v in data[kind].items()}

    return MachineCosts(
        cores=int(data["cores"]),
        backend=str(data["backend"]),
        all_reduce=lines("all_reduce"),
        send=Line(*map(float, data["send"])),
        reduce_scatter=lines("reduce_scatter"),
        all_gather=lines("all_gather"),
        figures={
            str(name): {str(k): float(v) for k, v in values.items()}
            for name, values in data["figures"].items()
        },
    )


def cache_root() -> Path:
    """Where the planner keeps what it measured (``PARATRAIN_CACHE`` moves it)."""
    return Path(os.environ.get("PARATRAIN_CACHE") or Path.home() / ".cache" / "paratrain")


def cache_dir() -> Path:
    return cache_root() / "machine"


def cache_key(devices: int, backend: str) -> str:
    name = f"{platform.node()}-{cores()}cores-{backend}-{devices}workers-torch{torch.__version__}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name)


def lone_worker_machine() -> MachineCosts:
    """One worker: nothing to send."""
    return MachineCosts(cores=cores(), backend="none", all_reduce={}, send=Line.zero())


def machine_costs(devices: int, *, refresh: bool = False) -> MachineCosts:
    """This machine's collectives for ``devices`` workers: from the cache, else measured
    (inside a job with its workers, once: the job's processes are placed already; outside
    one by starting ``devices`` local workers, ``launches`` times: ``middle_launch``)."""
    if devices < 2:
        return lone_worker_machine()
    backend = dist.get_backend() if comm.distributed() else _launch_backend()
    path = cache_dir() / f"{cache_key(devices, backend)}.json"
    cached = None if refresh else _read(path)
    if comm.distributed():  # rank 0's cache decides, so that all measure or none does
        shared = [cached if comm.rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        cached = shared[0]
    if cached is not None:
        return from_json(cached)
    if comm.distributed():
        data = to_json(measure_collectives())
    else:
        from paratrain.runtime.launch import launch

        runs = [launch(_measure_worker, devices=devices)[0] for _ in range(launches(devices))]
        data = middle_launch(runs)
    if not comm.distributed() or comm.rank() == 0:
        write_json(path, data)
    return from_json(data)


def read_json(path: Path) -> dict | None:
    """A file this program wrote (JSON, never a pickle), or None where absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read(path: Path) -> dict | None:
    """A cached measurement of the collectives, or None where absent, unreadable or of
    another format."""
    data = read_json(path)
    try:
        from_json(data or {})
    except (ValueError, KeyError, TypeError):
        return None
    return data if data.get("format") == FORMAT else None


def _launch_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def _lower_quartile(seconds: list[float]) -> float:
    """The repetition a quarter of the way up from the fastest (``after_work``)."""
    ordered = sorted(seconds)
    return ordered[(len(ordered) - 1) // 4]
