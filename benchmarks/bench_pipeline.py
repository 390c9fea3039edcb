"""paratrain's pipeline engine against torch.distributed.pipelining, side by side in one run.

For each model (mlp, gpt; and mlp-first-loaded, a split given for 2 stages with the
first stage's work near the last's, see ``MODELS``), stage count (2, 4) and schedule, one
launch builds the same split (paratrain's parameter-balanced partition, or the given one)
both ways in every worker: paratrain's engine, and torch's ``PipelineStage``s driven by
the matching schedule with the same micro-batches (m = 4p): GPipe - ``ScheduleGPipe``,
1F1B - ``Schedule1F1B``, interleaved 1F1B over 2 chunks per stage -
``ScheduleInterleaved1F1B`` on the same p x 2 pieces, ZB-H1 -
``ScheduleInterleavedZeroBubble`` (torch's zero-bubble schedule, ZB1P, here with one
stage per rank). torch has no ZB-H2: paratrain's ZB-H2 runs against the same
``ScheduleInterleavedZeroBubble`` as ZB-H1, and the peer column says so. The two alternate
round by round on the same global batches, so machine noise hits both alike.

Reported: median step time (max over ranks), samples/s, the throughput ratio
paratrain/torch, and paratrain's measured bubble next to torch's, measured the same way
on its passes (``torch_passes``: what both idle beyond theory on this machine shows
there), and next to two theories. The textbook one
assumes equal stages and free messages (``Timeline.theory``: (p-1)/(m+p-1), (p-1)/(vm+p-1),
or ZB-H1's (p-1)(F+B-W) from the run's mean pass times). The replayed one
(``replay.timeline_replay``) places the schedule's own action lists on this run's median
time of each stage's passes plus the message time seen in the timeline, so
measured/replayed near 1 says the engine idles no more than the schedule must on these
stages. Pass times vary from micro-batch to micro-batch on a shared CPU, and a late pass
makes its neighbours wait beyond what median times show, so a third theory replays each
step on its own measured passes, each stage from when it began the step
(``replay.stepwise_theory``): what the run idles beyond it is the engine's own gaps
between passes. The 10% goal is judged on it step by step:
the median over every measured step of every launch of that step's measured bubble over
its own replay's (``replay.stepwise_ratios``); the ratio of the two medians, printed
beside it, may pair one step's measured bubble with another's replay. The stage
imbalance is the slowest stage's busy time over the fastest's. After the table: each ZB
schedule's idle seconds per step over 1F1B's (the goal: ZB-H1 at most a third, judged on
the busiest stage's, what bounds the step, in a period of steps run back to back,
``step_periods``, against the lists replayed so), in a step alone and as the per-stage
mean, beside the paper's
(F+B-W)/(F+B+W) on the run's own pass times and the least any schedule can reach on these
stages (``start_floor``), and each row's goals. On a machine with
fewer cores than workers the figures are contended (the bubble then partly measures
waiting for a core): the table says so.

    python benchmarks/bench_pipeline.py            # full table
    python benchmarks/bench_pipeline.py --quick    # one short launch each
    python benchmarks/bench_pipeline.py --threads 1  # one core a stage, where cores spare
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from alternation import median_step_times, over_launches, slowest_rank
from step_periods import period_idles, replayed_period_idle, stage_pauses
from torch import nn
from torch_passes import PassTimer, median_idle

import paratrain
from paratrain.models import build_model, loss_for
from paratrain.parallel.pipeline.cost import in_flight
from paratrain.parallel.pipeline.partition import stage_bounds
from paratrain.parallel.pipeline.replay import (
    TimelineReplay,
    stepwise_ratios,
    stepwise_theory,
    timeline_replay,
)
from paratrain.parallel.pipeline.timeline import (
    Timeline,
    measured_steps,
    median_step,
    read_timeline,
    step_profile,
)
from paratrain.runtime.launch import thread_share
from paratrain.runtime.local_p2p import ENV as P2P_ENV

# Layers of equal size, so that stages can be balanced at layer granularity and the bubble
# compares with the theory, which assumes equal stages.
MODELS = {
    "mlp": {
        "options": {"in_features": 1024, "hidden": 1024, "depth": 4, "classes": 10},
        "global_batch": 512,
    },
    "gpt": {
        "options": {"vocab_size": 65, "block_size": 64, "n_layer": 8, "n_head": 4, "n_embd": 128},
        "global_batch": 64,
    },
    "mlp-first-loaded": {
        "kind": "mlp",
        "options": {"in_features": 1024, "hidden": 1024, "depth": 5, "classes": 10},
        "global_batch": 512,
        "balance": {2: [7, 5]},
    },
}
"""``mlp-first-loaded`` runs at 2 stages only: the first stage holds three of the five
hidden layers, the last two and the head. Under a split backward the first stage (fed
data) runs its backward whole as W, with no B, and so has less work than an equal share
of layers; with one layer more it carries at least the last stage's work (1.2-1.3x here)
and has no slack to hide late W passes in, as on the stages the paper's bubbles assume,
where the parameter-balanced splits of ``mlp`` and ``gpt`` leave their zero-bubble rows'
first stage with slack.
Interleaved 1F1B, which cuts p x 2 pieces, is not run on it."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
"""Bench names: ``interleaved`` is paratrain's 1f1b with ``virtual_stages=2``."""
PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-h2": "ScheduleInterleavedZeroBubble",
}
PEER_NOTES = {"zb-h2": "torch has no ZB-H2"}
"""Said in the peer column where torch's schedule is not the same schedule."""
CHUNKS = {"interleaved": 2}
PEER_SCHEDULE = {"interleaved": "1f1b"}
"""paratrain's schedule name for a bench name."""


def kind_of(name: str, spec: dict) -> str:
    """The model kind ``build_model`` and ``loss_for`` know: the bench name itself, or a
    spec's ``kind`` where one kind runs under another name (``mlp-first-loaded``)."""
    return spec.get("kind", name)


def make_batches(name: str, spec: dict, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batch = spec["global_batch"]
    out = []
    for _ in range(count):
        if kind_of(name, spec) == "gpt":
            vocab, block = spec["options"]["vocab_size"], spec["options"]["block_size"]
            x = torch.randint(0, vocab, (batch, block), generator=generator)
            y = torch.randint(0, vocab, (batch, block), generator=generator)
        else:
            x = torch.randn(batch, spec["options"]["in_features"], generator=generator)
            y = torch.randint(0, spec["options"]["classes"], (batch,), generator=generator)
        out.append((x, y))
    return out


def fresh_model(name: str, spec: dict) -> nn.Sequential:
    torch.manual_seed(0)
    return build_model(kind_of(name, spec), **spec["options"])


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


class ParatrainRunner:
    def __init__(self, name: str, spec: dict, stages: int, micro: int, schedule: str) -> None:
        self.engine = paratrain.setup(
            fresh_model(name, spec),
            optimizer=sgd,
            loss_fn=loss_for(kind_of(name, spec)),
            strategy="pipeline",
            stages=stages,
            micro_batches=micro,
            schedule=PEER_SCHEDULE.get(schedule, schedule),
            virtual_stages=CHUNKS.get(schedule, 1),
            **({"balance": spec["balance"][stages]} if "balance" in spec else {}),
        )

    def step(self, x, y) -> None:
        self.engine.train_step(x, y)


class TorchRunner:
    """torch.distributed.pipelining on the same split, micro-batches and loss."""

    def __init__(
        self, name: str, spec: dict, balance: list[int], micro: int, schedule: str
    ) -> None:
        from torch.distributed import pipelining

        rank, stages = dist.get_rank(), dist.get_world_size()
        bounds = stage_bounds(balance)  # p x v pieces: piece c * p + rank is chunk c here
        layers = fresh_model(name, spec)
        modules, pipe_stages = [], []
        for piece in range(rank, len(bounds), stages):
            start, end = bounds[piece]
            modules.append(nn.Sequential(*[layers[i] for i in range(start, end)]))
            pipe_stages.append(
                pipelining.PipelineStage(modules[-1], piece, len(bounds), torch.device("cpu"))
            )
        self.timer = PassTimer(rank)  # torch's bubble, measured as ours (``torch_passes``)
        for pipe_stage in pipe_stages:
            self.timer.wrap(pipe_stage)
        params = [p for module in modules for p in module.parameters()]
        # a worker whose pieces hold no parameters (an activation alone, at p x 2 pieces
        # of a short layer list) has nothing to step; torch's optimizer refuses none
        self.optimizer = sgd(params) if params else None
        self.first, self.last = rank == 0, rank == stages - 1
        kind = getattr(pipelining, PEERS[schedule])
        single = schedule in ("gpipe", "1f1b")  # torch's single-stage schedules take one
        self.schedule = kind(
            pipe_stages[0] if single else pipe_stages,
            n_microbatches=micro,
            loss_fn=loss_for(kind_of(name, spec)),
        )

    def step(self, x, y) -> None:
        self.timer.step += 1
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        if self.optimizer is not None:
            self.optimizer.step()


def bench_worker(
    name: str, spec: dict, schedule: str, rounds: int, steps: int, run_dir: str
) -> dict:
    stages = dist.get_world_size()
    micro = 4 * stages
    ours = ParatrainRunner(name, spec, stages, micro, schedule)
    runners = {
        "paratrain": ours,
        "torch": TorchRunner(name, spec, ours.engine.balance, micro, schedule),
    }
    batches = make_batches(name, spec, steps)
    for runner in runners.values():  # warm up, then time only what the timeline records
        for x, y in batches[:2]:
            runner.step(x, y)
    ours.engine.events.clear()
    runners["torch"].timer.passes.clear()
    medians = median_step_times(runners, batches, rounds=rounds, warmup=0)
    ours.engine.write_timeline(run_dir, last_steps=ours.engine.steps_taken)
    return {
        "median_s": medians,
        "peer": PEERS[schedule],
        "balance": ours.engine.balance,
        "activation_peak": ours.engine.activation_peak_bytes(),
        "torch_passes": runners["torch"].timer.passes,
        "flush": ours.engine.flush,
    }


def busiest_stage_idle(timeline: Timeline) -> float:
    """Median over the measured steps of the idle seconds of the stage with the most work
    in that step: what the schedule adds to the step beyond the work that bounds it. The
    per-stage mean idle also counts a lighter stage's waiting, which no schedule removes
    (a zero-bubble first stage, fed data, has no input gradient to make and so does less
    work than the others)."""
    idles = []
    for step in measured_steps(timeline, 0):
        span, busy = step_profile(timeline, step, 0)
        idles.append(span - max(busy.values()))
    return statistics.median(idles)


def zero_bubble_floor(timeline: Timeline) -> float | None:
    """ZB-H1's idle over 1F1B's on equal stages with this run's mean pass times, from the
    paper's formulas: (p-1)(F+B-W) over (p-1)(F+B+W). It is 1/3 only where W = (F+B)/2,
    the paper's F = B = W; None for a schedule whose backward is not split."""
    times = timeline.mean_times()
    if not all(kind in times for kind in ("forward", "backward", "weight")):
        return None
    forward, backward, weight = times["forward"], times["backward"], times["weight"]
    return (forward + backward - weight) / (forward + backward + weight)


def start_floor(replayed: TimelineReplay) -> float:
    """The least idle any schedule leaves the replay's busiest stage: none of its passes
    can start before the first micro-batch's forward has crossed every stage before it
    (each one's first chunk, and a message each). Over 1F1B's replayed idle on its busiest
    stage it is the lowest ratio any schedule with a flush can reach on these stages:
    above the third where the last stage is the busiest and the first stage's backward is
    short (it makes no input gradient), as on the bench's mlp; 0 where the first stage is
    the busiest (mlp-first-loaded)."""
    busy = replayed.replay.busy
    busiest = busy.index(max(busy))
    return sum(replayed.durations[stage, 0, "F"] + replayed.hop_s for stage in range(busiest))


def launch(
    name: str, stages: int, schedule: str, rounds: int, steps: int, threads: int | None
) -> tuple[list[dict], Timeline]:
    """One launch of ``bench_worker``: each worker's result, and paratrain's timeline."""
    # The spec travels with the call: spawned workers re-import this module afresh.
    with tempfile.TemporaryDirectory() as run_dir:
        results = paratrain.launch(
            bench_worker,
            devices=stages,
            args=(name, MODELS[name], schedule, rounds, steps, run_dir),
            threads_per_worker=threads,
        )
        return results, read_timeline(Path(run_dir) / "timeline.jsonl")


def runs_as_given(name: str, stages: int, schedule: str) -> bool:
    """Whether ``name`` runs at ``stages`` under ``schedule``: a split given for some stage
    counts (``balance``) runs at those only, one piece a stage (no virtual stages)."""
    given = MODELS[name].get("balance")
    return given is None or (stages in given and schedule not in CHUNKS)


def measure(
    name: str, stages: int, schedule: str, rounds: int, steps: int, threads: int | None
) -> dict:
    results, timeline = launch(name, stages, schedule, rounds, steps, threads)
    step, bubble = median_step(timeline)
    span = step_profile(timeline, step, 0)[0]
    (theory, formula), replayed = timeline.theory(), timeline_replay(timeline)
    stepwise = stepwise_theory(timeline, hop_s=replayed.hop_s)
    median = slowest_rank([r["median_s"] for r in results])
    peer = median_idle([p for r in results for p in r["torch_passes"]], stages)
    pauses = stage_pauses(timeline, steps)
    return {
        "median": median,
        "bubble": bubble,
        "idle_s": bubble * span,  # per-stage mean idle seconds of the median step
        "theory": theory,
        "formula": formula,
        "replayed": replayed.bubble,
        "stepwise": stepwise,
        "stepwise_ratios": stepwise_ratios(timeline, hop_s=replayed.hop_s),
        "replayed_idle_s": replayed.bubble * replayed.replay.makespan,
        "replayed_busiest_idle_s": replayed.replay.makespan - max(replayed.replay.busy),
        "busiest_idle_s": busiest_stage_idle(timeline),
        "period_idle_s": statistics.median(period_idles(timeline, steps)),
        "replayed_period_idle_s": replayed_period_idle(timeline, replayed, pauses),
        "flush": results[0]["flush"],
        "start_floor_s": start_floor(replayed),
        "torch_bubble": peer.bubble,
        "torch_idle_s": peer.idle_s,
        "torch_busiest_idle_s": peer.busiest_idle_s,
        "zb_floor": zero_bubble_floor(timeline),
        "hop_s": replayed.hop_s,
        "imbalance": replayed.replay.imbalance,
        "balance": results[0]["balance"],
        "activation_peak": [r["activation_peak"] for r in results],
    }


def build_row(name: str, stages: int, schedule: str, runs: list[dict], threads: int) -> dict:
    """One configuration's figures, medians over its launches."""
    median, ratios = over_launches([r["median"] for r in runs], ours="paratrain", peer="torch")
    micro, batch = 4 * stages, MODELS[name]["global_batch"]

    def over_runs(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    bubble, theory, replayed = over_runs("bubble"), over_runs("theory"), over_runs("replayed")
    note = PEER_NOTES.get(schedule)
    return {
        "model": name,
        "stages": stages,
        "schedule": schedule,
        "peer": PEERS[schedule] + (f"; {note}" if note else ""),
        "contended": stages * threads > len(os.sched_getaffinity(0)),
        "threads_per_stage": threads,
        "micro_batches": micro,
        "global_batch": batch,
        "balance": runs[0]["balance"],
        "median_step_s": median,
        "samples_per_s": {key: batch / value for key, value in median.items()},
        "paratrain_over_torch": statistics.median(ratios),
        "paratrain_over_torch_range": [min(ratios), max(ratios)],
        "bubble_measured": bubble,
        "torch_bubble_measured": over_runs("torch_bubble"),
        "bubble_theory": theory,
        "bubble_formula": runs[0]["formula"],
        "bubble_ratio": bubble / theory if theory else float("inf"),
        "bubble_replayed": replayed,
        "replayed_ratio": bubble / replayed,
        "bubble_stepwise": over_runs("stepwise"),
        "stepwise_ratio_of_medians": bubble / over_runs("stepwise"),
        "stepwise_ratio": statistics.median(x for r in runs for x in r["stepwise_ratios"]),
        "stepwise_steps": sum(len(r["stepwise_ratios"]) for r in runs),
        "hop_s": over_runs("hop_s"),
        "stage_imbalance": over_runs("imbalance"),
        "idle_s_per_step": {
            "measured": over_runs("idle_s"),
            "replayed": over_runs("replayed_idle_s"),
            "busiest_stage": over_runs("busiest_idle_s"),
            "replayed_busiest_stage": over_runs("replayed_busiest_idle_s"),
            "torch": over_runs("torch_idle_s"),
            "torch_busiest_stage": over_runs("torch_busiest_idle_s"),
            "busiest_stage_per_period": over_runs("period_idle_s"),
            "replayed_busiest_stage_per_period": over_runs("replayed_period_idle_s"),
        },
        "steps_end_together": runs[0]["flush"],
        "zero_bubble_floor": (None if runs[0]["zb_floor"] is None else over_runs("zb_floor")),
        "busiest_start_floor_s": over_runs("start_floor_s"),
        "activation_peak_bytes": runs[0]["activation_peak"],
        "in_flight_theory": [
            in_flight(
                PEER_SCHEDULE.get(schedule, schedule),
                stages,
                s,
                micro,
                chunks,
                flush=runs[0]["flush"],
            )
            for s in range(stages)
            for chunks in [CHUNKS.get(schedule, 1)]
        ],
    }


def run(models, stage_counts, schedules, rounds, steps, repeats, threads=None) -> list[dict]:
    """Every configuration's row, printed as it comes; then each row's goals and the ZB
    schedules' idle seconds over 1F1B's added (``add_goals``). ``threads`` per stage
    process, else ``paratrain.launch``'s share of this machine's cores."""
    if steps < MIN_STEPS:
        raise ValueError(f"steps must be at least {MIN_STEPS} a round, not {steps}.")
    rows = []
    for name in models:
        for stages in stage_counts:
            share = threads or thread_share(stages)
            for schedule in schedules:
                if not runs_as_given(name, stages, schedule):
                    continue
                runs = [
                    measure(name, stages, schedule, rounds, steps, threads) for _ in range(repeats)
                ]
                rows.append(build_row(name, stages, schedule, runs, share))
                print(format_row(rows[-1]), flush=True)
    add_goals(rows)
    return rows


MIN_STEPS = 3
"""Steps in a row a round needs for one steady period (``step_periods.steady_periods``)."""
ZB_GOAL = 1 / 3
"""The issue's goal: a ZB schedule's idle time per step at most a third of 1F1B's, judged
on the busiest stage's idle in a period of steps run back to back (``step_periods``): the
bubble the schedule adds to each step of a run, where a step measured alone overlaps its
neighbours (ZB-H1's lists for steps back to back). The busiest stage's idle in a step
alone and the per-stage mean, printed beside it, are the figures of earlier runs; the
mean also holds a lighter stage's waiting for the busiest, about the same under every
schedule (each stage does the same work under each), which no schedule removes."""


def add_goals(rows: list[dict]) -> None:
    """Each row's goals (measured within 10% of replayed, paratrain's samples/s at least
    torch's) and, for ZB rows, idle seconds per step over 1F1B's of the same model and
    stage count (None where 1F1B was not run)."""
    one_f_one_b = {(r["model"], r["stages"]): r for r in rows if r["schedule"] == "1f1b"}
    for row in rows:
        row["goals"] = {
            "measured_within_10pct_of_replayed": abs(row["stepwise_ratio"] - 1) <= 0.10,
            "samples_per_s_ratio_at_least_1": row["paratrain_over_torch"] >= 1.0,
        }
        if not row["schedule"].startswith("zb"):
            continue
        base = one_f_one_b.get((row["model"], row["stages"]))
        row["idle_over_1f1b"] = None
        if base is not None:
            idle, base_idle = row["idle_s_per_step"], base["idle_s_per_step"]
            ratio = {key: idle[key] / base_idle[key] for key in idle}
            ratio["any_schedule_floor"] = (
                row["busiest_start_floor_s"] / base_idle["replayed_busiest_stage"]
            )
            row["idle_over_1f1b"] = ratio
            met = ratio["busiest_stage_per_period"] <= ZB_GOAL
            row["goals"]["idle_at_most_a_third_of_1f1b"] = met


def summary_lines(rows: list[dict]) -> list[str]:
    """After the table: ZB idle seconds over 1F1B's per model and stage count, then one
    goals line per row."""
    lines = [
        "",
        "ZB idle seconds per step over 1F1B's (goal: the busiest stage's per period <= 1/3):",
    ]
    zb = [row for row in rows if row["schedule"].startswith("zb")]
    for row in zb:
        where = f"{row['model']} {row['stages']} stages {row['schedule']}"
        ratio = row["idle_over_1f1b"]
        if ratio is None:
            lines.append(f"  {where}: 1f1b not run, no ratio")
            continue
        met = _yes(row["goals"]["idle_at_most_a_third_of_1f1b"])
        floor = row["zero_bubble_floor"]
        lines.append(
            f"  {where}: the busiest stage's idle per period "
            f"{ratio['busiest_stage_per_period']:.2f} ({met}) (replayed back to back "
            f"{ratio['replayed_busiest_stage_per_period']:.2f}); in a step alone "
            f"{ratio['busiest_stage']:.2f} "
            f"(replayed {ratio['replayed_busiest_stage']:.2f}; no schedule below "
            f"{ratio['any_schedule_floor']:.2f} on these stages); per-stage mean "
            f"{ratio['measured']:.2f}, replayed {ratio['replayed']:.2f}"
            + (f"; (F+B-W)/(F+B+W) on this run's passes {floor:.2f}" if floor is not None else "")
            + f"; torch's {PEERS[row['schedule']]} over its Schedule1F1B: "
            f"{ratio['torch']:.2f}, the busiest stage's {ratio['torch_busiest_stage']:.2f}"
        )
    if not zb:
        lines.append("  no ZB schedule run")
    else:
        lines.append(
            "  (the busiest stage's idle per period: from one step's start to the next's in a "
            "run of steps, less that stage's passes and its own work between steps (its "
            "optimizer step, the next step's setup): its waiting for other stages; "
            "replayed back to back: the same of the lists placed as steps in a row on this "
            "run's stage times and pauses; in a step alone: from its first pass to its "
            "last, replayed: the same of the lists placed on this run's stage times; no "
            "schedule below: that stage's wait for the first forward to reach it, which "
            "every schedule has in a step alone, over 1F1B's replayed idle; "
            "the per-stage mean also holds the lighter stages' waiting for the "
            "busiest, alike under every schedule; (F+B-W)/(F+B+W): ZB-H1's over 1F1B's on "
            "equal stages with these pass times, 1/3 only where W = (F+B)/2)"
        )
    lines += ["", "Goals per row:"]
    for row in rows:
        goals = row["goals"]
        lines.append(
            f"  {row['model']} {row['stages']} x {row['micro_batches']} {row['schedule']}: "
            f"measured within 10% of replayed on its own passes: "
            f"{_yes(goals['measured_within_10pct_of_replayed'])} ({row['stepwise_ratio']:.2f}); "
            f"samples/s ratio >= 1: {_yes(goals['samples_per_s_ratio_at_least_1'])} "
            f"({row['paratrain_over_torch']:.2f})"
        )
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


HEADER = (
    "| model | stages x micro | schedule (torch peer) | torch ms | paratrain ms "
    "| torch samples/s | paratrain samples/s | paratrain/torch (range) | bubble measured "
    "| torch's bubble, measured alike | bubble textbook, equal stages | measured/textbook "
    "| bubble replayed (this run's stage times + hop) | measured/replayed | hop ms "
    "| bubble replayed on each step's own passes | measured/that (medians) "
    "| measured/that, step by step "
    "| stage imbalance (slowest/fastest busy) "
    "| activation peak per stage (MiB) | in flight per stage (theory, stages' worth) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    ms = {key: f"{value * 1e3:.1f}" for key, value in row["median_step_s"].items()}
    low, high = row["paratrain_over_torch_range"]
    contended = " (contended)" if row["contended"] else ""
    return (
        f"| {row['model']} | {row['stages']} x {row['micro_batches']}{contended} "
        f"| {row['schedule']} ({row['peer']}) "
        f"| {ms['torch']} | {ms['paratrain']} | {row['samples_per_s']['torch']:.0f} "
        f"| {row['samples_per_s']['paratrain']:.0f} "
        f"| {row['paratrain_over_torch']:.2f} ({low:.2f}-{high:.2f}) "
        f"| {row['bubble_measured']:.1%} | {row['torch_bubble_measured']:.1%} "
        f"| {row['bubble_theory']:.1%} "
        f"| {row['bubble_ratio']:.2f} | {row['bubble_replayed']:.1%} "
        f"| {row['replayed_ratio']:.2f} | {row['hop_s'] * 1e3:.3f} "
        f"| {row['bubble_stepwise']:.1%} | {row['stepwise_ratio_of_medians']:.2f} "
        f"| {row['stepwise_ratio']:.2f} "
        f"| {row['stage_imbalance']:.2f} "
        f"| {', '.join(f'{b / 2**20:.1f}' for b in row['activation_peak_bytes'])} "
        f"| {', '.join(f'{n:g}' for n in row['in_flight_theory'])} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help="steps in a row a round (at least 3: a round's first step follows a barrier, "
        "so its period is left out of the idle per period, which needs a step after it)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="launches per configuration")
    parser.add_argument("--quick", action="store_true", help="1 launch of 2 rounds x 3 steps")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per stage process (default: the cores shared out, as "
        "paratrain.launch does); 1 on a machine with cores to spare gives each stage one "
        "core, uncontended",
    )
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be at least {MIN_STEPS}, not {args.steps}.")
    rounds, steps, repeats = (
        (2, MIN_STEPS, 1) if args.quick else (args.rounds, args.steps, args.repeats)
    )
    print(f"torch {torch.__version__}, {repeats} launch(es) x {rounds} rounds x {steps} steps")
    gloo = os.environ.get(P2P_ENV, "").strip() == "gloo"
    print(
        "paratrain's stages exchange messages through "
        + (f"gloo ({P2P_ENV}=gloo)" if gloo else "shared memory (runtime/local_p2p.py)")
        + "; torch's through gloo"
    )
    print(HEADER, flush=True)
    rows = run(args.models, args.stages, args.schedules, rounds, steps, repeats, args.threads)
    print("\n".join(summary_lines(rows)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
