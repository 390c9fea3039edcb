"""Which server holds which parameter: a greedy split by bytes (pure, no processes).

Why greedy by bytes rather than by count or by layer: a server's work per push (receive,
optimizer step, send back) is proportional to the bytes it holds, so the slowest server
sets the pace; placing the largest tensors first, each on the server holding the fewest
bytes so far, keeps the largest server within one tensor of the mean. The split depends
only on names and sizes, so every worker and every server computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a server sees it: canonical name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype)}

    @staticmethod
    def from_json(data: dict) -> ParamSpec:
        dtype = getattr(torch, data["dtype"].removeprefix("torch."))
        return ParamSpec(data["name"], tuple(data["shape"]), dtype)


def check_servers(servers: object, parameter_count: int) -> int:
    """Refuse a server count that is not a positive integer or leaves a server empty."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be a positive integer, not {servers!r}.")
    if servers > parameter_count:
        raise ValueError(
            f"servers={servers} but the model has only {parameter_count} parameter tensor(s), "
            f"so some server would hold nothing; use at most {parameter_count} server(s)."
        )
    return servers


def assign_shards(params: Sequence[ParamSpec], servers: int) -> list[list[ParamSpec]]:
    """Each server's parameters, in model order; largest tensors placed first.

    Ties (equal sizes, equal loads) go to the earlier parameter and the lower server, so
    the result is deterministic.
    """
    check_servers(servers, len(params))
    order = sorted(range(len(params)), key=lambda i: (-params[i].nbytes, i))
    loads = [0] * servers
    owner: dict[int, int] = {}
    for index in order:
        target = min(range(servers), key=lambda s: (loads[s], s))
        owner[index] = target
        loads[target] += params[index].nbytes
    return [[p for i, p in enumerate(params) if owner[i] == s] for s in range(servers)]
