"""How long a launch takes before the function runs: paratrain's forked workers against
spawned ones and against ``torch.multiprocessing.spawn``, the peer a plain PyTorch script uses.

Each way runs in a fresh Python process that has imported torch and paratrain, as a
user's script has, and times launches of a function that only forms the gloo group and
meets its peers at a barrier (``--work optimizer``: and first makes an optimizer, as
every training function does, whose first construction in a process imports torch's
compiler front end, ``torch._dynamo``): the first launch of the process (what
``paratrain train`` pays once; for the forkserver it includes starting the server, which
imports torch and its compiler front end once) and the median of the later ones (what
a script, the planner or a test suite that launches again pays each time). Medians over
``--repeats`` fresh processes, the ways alternated so that machine noise hits each alike;
ratios against the peer.

    python benchmarks/launch_start.py                    # 2 and 4 workers, 5 processes each
    python benchmarks/launch_start.py --devices 2 --repeats 3
    python benchmarks/launch_start.py --work optimizer --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

WAYS = ("paratrain (forkserver)", "paratrain (spawn)", "torch.multiprocessing.spawn")


def _work_then_barrier(work: str = "barrier") -> None:
    import torch
    import torch.distributed as dist

    if work == "optimizer":
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    dist.barrier()


def _peer_worker(rank: int, world: int, port: int, work: str = "barrier") -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    _work_then_barrier(work)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _time_launches(way: str, devices: int, later: int, work: str) -> list[float]:
    """In the child: seconds for the first launch, then for each later one."""
    import torch.multiprocessing as tmp

    import paratrain

    times = []
    for _ in range(1 + later):
        start = time.perf_counter()
        if way == "torch.multiprocessing.spawn":
            tmp.spawn(_peer_worker, args=(devices, _free_port(), work), nprocs=devices)
        else:
            paratrain.launch(_work_then_barrier, devices=devices, args=(work,))
        times.append(time.perf_counter() - start)
    return times


def _child_run(way: str, devices: int, later: int, work: str) -> list[float]:
    env = dict(os.environ)
    env["PARATRAIN_START_METHOD"] = "spawn" if way == "paratrain (spawn)" else "forkserver"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, __file__, "--later", str(later), "--work", work]
        + ["--child", way, str(devices)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per way")
    parser.add_argument("--later", type=int, default=5, help="launches after the first")
    parser.add_argument(
        "--work",
        choices=("barrier", "optimizer"),
        default="barrier",
        help="what the launched function does: meet at a barrier, or make an optimizer first",
    )
    parser.add_argument("--child", nargs=2, metavar=("WAY", "DEVICES"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        way, devices = options.child
        print(json.dumps(_time_launches(way, int(devices), options.later, options.work)))
        return 0
    print(
        f"{os.cpu_count()} cores; the function: {options.work}; medians over "
        f"{options.repeats} fresh processes, seconds"
    )
    print("| workers | way | first launch | later launches | first / peer's | later / peer's |")
    print("|---|---|---|---|---|---|")
    for devices in options.devices:
        firsts: dict[str, list[float]] = {way: [] for way in WAYS}
        laters: dict[str, list[float]] = {way: [] for way in WAYS}
        for repeat in range(options.repeats):
            for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:
                times = _child_run(way, devices, options.later, options.work)
                firsts[way].append(times[0])
                laters[way].append(statistics.median(times[1:]))
        peer = WAYS[-1]
        first_peer = statistics.median(firsts[peer])
        later_peer = statistics.median(laters[peer])
        for way in WAYS:
            first, later = statistics.median(firsts[way]), statistics.median(laters[way])
            print(
                f"| {devices} | {way} | {first:.2f} | {later:.2f} | "
                f"{first / first_peer:.2f} | {later / later_peer:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
