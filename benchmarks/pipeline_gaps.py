"""Where paratrain's pipeline engine idles beyond its schedule: the gap at each pass.

``bench_pipeline.py`` judges the engine by its measured bubble over the schedule replayed
on each step's own passes; this says where the difference lies. It launches the same
configuration as the bench (paratrain and torch alternating in the same workers, on the
same split), reads paratrain's timeline and gives, per stage, chunk, pass kind and what
bound the pass (its stage's previous pass, or an input from another device), how much
later the passes started than they could have (``replay.engine_gaps``): count a step,
median, mean and seconds a step; then the forwards that receive their input by micro-
batch, whose first of a round waits on the round's header; then each stage's total a
step. A stage's gaps a step over its span is roughly what its measured bubble exceeds
the own-pass replay by.

    python benchmarks/pipeline_gaps.py --model mlp --schedule 1f1b
    python benchmarks/pipeline_gaps.py --model mlp --schedule interleaved --launches 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from bench_pipeline import MODELS, SCHEDULES, launch, runs_as_given

from paratrain.parallel.pipeline.replay import PassGap, engine_gaps
from paratrain.parallel.pipeline.timeline import measured_steps


def summary(gaps: list[PassGap], steps: int, stages: int) -> list[str]:
    """The report's lines (``steps``: measured steps over all launches)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    first: dict[tuple, list[float]] = defaultdict(list)
    totals: dict[int, float] = defaultdict(float)
    for gap in gaps:
        groups[gap.stage, gap.chunk, gap.kind, gap.bound].append(gap.seconds)
        if gap.kind == "F" and gap.chunk * stages + gap.stage > 0:  # fed by the stage before
            first[gap.stage, gap.chunk, gap.micro == 0].append(gap.seconds)
        totals[gap.stage] += gap.seconds
    lines = ["| stage | chunk | pass | bound by | a step | median us | mean us | ms a step |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for (stage, chunk, kind, bound), values in sorted(groups.items()):
        lines.append(
            f"| {stage} | {chunk} | {kind} | {bound} | {len(values) / steps:.1f} | "
            f"{statistics.median(values) * 1e6:.0f} | {statistics.fmean(values) * 1e6:.0f} | "
            f"{sum(values) / steps * 1e3:.2f} |"
        )
    lines.append("")
    lines.append("Forwards fed by another device, the round's first against the rest (us):")
    for (stage, chunk, is_first), values in sorted(first.items()):
        which = "micro-batch 0" if is_first else "the others"
        median, mean = statistics.median(values) * 1e6, statistics.fmean(values) * 1e6
        lines.append(
            f"  stage {stage} chunk {chunk}, {which}: median {median:.0f}, mean {mean:.0f}"
        )
    lines.append("")
    for stage, total in sorted(totals.items()):
        lines.append(f"stage {stage}: {total / steps * 1e3:.2f} ms of gaps a step")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if not runs_as_given(args.model, args.stages, args.schedule):
        given = sorted(MODELS[args.model]["balance"])
        parser.error(
            f"{args.model} is a split given for {given} stages, one piece a stage; "
            "pick those stages and a schedule without virtual stages."
        )
    gaps, steps = [], 0
    for _ in range(args.launches):
        _, timeline = launch(args.model, args.stages, args.schedule, args.rounds, args.steps, None)
        gaps += engine_gaps(timeline)
        steps += len(measured_steps(timeline, 0))
    print(f"{args.model}, {args.stages} stages, {args.schedule}: {steps} measured steps")
    print("\n".join(summary(gaps, steps, args.stages)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
