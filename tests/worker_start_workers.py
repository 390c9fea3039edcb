"""Worker functions for test_worker_start; this module reads the environment as it is
imported, which happens in the worker, when its function is unpickled there."""

from __future__ import annotations

import os
import sys

MARK = "PARATRAIN_TEST_START_MARK"
SEEN_ON_IMPORT = os.environ.get(MARK)


def environment_seen() -> tuple[str | None, str | None]:
    """The mark as this module's import saw it, and as the running worker sees it."""
    return SEEN_ON_IMPORT, os.environ.get(MARK)


def random_draws() -> list[float]:
    import torch

    return torch.rand(4).tolist()


def parent_pid() -> int:
    return os.getppid()


def compiler_loaded() -> bool:
    """Whether torch's compiler front end was imported before this function ran (the
    first optimizer a process makes imports it: about a second of a core)."""
    return "torch._dynamo" in sys.modules


def put_rank(queue) -> None:
    import torch.distributed as dist

    queue.put(dist.get_rank())


def say_on_both_streams(words: str) -> None:
    """One write a line (``print`` writes stderr's newline apart, and lines of two
    workers could interleave)."""
    import torch.distributed as dist

    for stream, name in ((1, "out"), (2, "err")):
        os.write(stream, f"{words} {name} {dist.get_rank()}\n".encode())


def report_start_state(queue) -> None:
    """What a process forked from the server starts with: SIGTERM's action, a torch seed."""
    import signal

    import torch

    queue.put((signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, torch.initial_seed()))
