"""Turning a collective's timeout into a sentence that names who did not arrive.

Gloo and NCCL time out with "Timed out waiting 30000ms for recv", which says nothing about
which worker is missing. Each worker counts the collectives it enters (cheap: an integer
and a string, no message). When one times out, that worker posts a query on the job's
rendezvous store; a small daemon thread in every other worker answers with its own count
and the operation it is in, if any; the timed-out worker then raises ``CollectiveTimeout``
naming the operation, the worker(s) that did not arrive, and where they are instead. The
happy path costs nothing but the counter: the thread sleeps on the store until a query.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

STORE_ENV = "PARATRAIN_STORE"
_QUERY = "paratrain/hang/query"
_ANSWER_WAIT_S = 3.0
_state: dict[str, Any] = {"seq": 0, "op": None, "monitor": None}


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


def _client():
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def _answer_key(rank: int) -> str:
    return f"paratrain/hang/rank/{rank}"


def _position() -> str:
    return json.dumps({"seq": _state["seq"], "op": _state["op"]})


def _monitor(rank: int) -> None:
    """Sleep on the store until some worker asks where everyone is, then answer once."""
    try:
        store = _client()
        while True:
            try:
                store.wait([_QUERY], timedelta(hours=1))
                break
            except Exception:  # the wait's own timeout: keep sleeping
                continue
        store.set(_answer_key(rank), _position())
    except Exception:  # the job is ending; a missing answer is reported as such
        return


def _ensure_monitor() -> None:
    if _state["monitor"] is not None or STORE_ENV not in os.environ or not dist.is_initialized():
        return
    thread = threading.Thread(
        target=_monitor, args=(dist.get_rank(),), name="paratrain-hang-monitor", daemon=True
    )
    thread.start()
    _state["monitor"] = thread


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@contextmanager
def collective(op: str):
    """Mark a collective (or the wait for one); a timeout inside becomes CollectiveTimeout."""
    _ensure_monitor()
    _state["seq"] += 1
    _state["op"] = op
    try:
        yield
    except RuntimeError as error:
        if not _is_timeout(error) or STORE_ENV not in os.environ:
            raise
        raise CollectiveTimeout(diagnose(op, error)) from None
    finally:
        _state["op"] = None


def diagnose(op: str, error: BaseException) -> str:
    """Ask every worker where it is, and say who did not arrive at ``op``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _state["seq"]
    answers: dict[int, dict] = {}
    try:
        store = _client()
        store.set(_answer_key(rank), _position())
        store.set(_QUERY, "1")
        deadline = time.monotonic() + _ANSWER_WAIT_S
        while time.monotonic() < deadline and len(answers) < world:
            for other in range(world):
                if other not in answers and store.check([_answer_key(other)]):
                    answers[other] = json.loads(store.get(_answer_key(other)))
            time.sleep(0.05)
    except Exception:  # the store itself is gone: say what we know
        pass
    missing = []
    for other in range(world):
        if other == rank:
            continue
        seen = answers.get(other)
        if seen is None:
            missing.append(f"rank {other} did not answer (dead, or stuck outside Python)")
        elif seen["seq"] < mine or seen["op"] != op:
            where = f"is in {seen['op']}" if seen["op"] else "is not in any collective"
            missing.append(f"rank {other} did not arrive ({where}, #{seen['seq']})")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    who = "; ".join(missing) if missing else "every rank reports being in it (a slow network?)"
    return (
        f"{op} (collective #{mine} of rank {rank}) timed out: {who}. "
        f"Backend said: {first_line[:200]}"
    )
