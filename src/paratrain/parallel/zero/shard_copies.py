"""zero2's shard copies: each worker also keeps its ring neighbour's optimizer shard.

Why: zero2 keeps each slice of the optimizer state on one worker only, so a worker's death
takes its slice with it and ``--elastic`` has to go back to the newest checkpoint. With
``shard_copies`` every worker ``r`` also holds worker ``r + 1``'s slice (parameters and
optimizer state), so a single death, or any deaths of workers that are not ring
neighbours, leaves every slice somewhere (``shard_recovery`` puts them back together).

Why the state itself is sent, not the reduced gradient: the gradient slice is 1/3 of the
bytes under Adam, but the neighbour would then replay the owner's optimizer step on its
copy, and a replay is bitwise the owner's only if it takes the same kernel path on the
same alignment; the state, sent after the step, is the owner's by construction. The cost
per step is one point-to-point message each way round the ring (4 + state bytes per
parameter, over the replicas), after the parameter all-gather.

Versions: a slice's version is the number of optimizer steps applied to it. A death in
the middle of a step can leave a survivor's own slice one step ahead of the others, so
each worker keeps what it last sent (its slice as of the last completed step) beside its
live slice; the recovery picks one version every slice is held at, or gives up (then the
run goes back to the checkpoint). The memory is booked under ``optimizer``: the copy and
the kept send buffer, each one slice of parameters plus optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.parallel.options import StrategyOption
from paratrain.parallel.zero.shards import FlatUnit
from paratrain.runtime import comm

SHARD_COPIES = StrategyOption(
    "shard_copies",
    bool,
    False,
    "zero2 only: each worker also keeps its ring neighbour's optimizer shard, so --elastic "
    "goes on after a death without the checkpoint (one more shard of state per worker)",
)


@dataclass
class HeldShard:
    """One replica rank's slice as some worker holds it: its version, and per unit the
    parameter slice and the optimizer state (elementwise tensors and scalars)."""

    version: int
    units: list[dict[str, Any]]


class ShardCopies:
    """The ring exchange and what it leaves: the neighbour's slice and our last sent one."""

    def __init__(self, units: list[FlatUnit], optimizer, group, rank: int, world: int) -> None:
        self.units, self.optimizer, self.group = units, optimizer, group
        self.rank, self.world = rank, world
        self.copy: HeldShard | None = None
        """Replica rank ``rank + 1``'s slice, as received at the end of its last step."""
        self.sent: HeldShard | None = None
        """Our own slice as sent at the end of the last completed step."""
        self.version = 0
        """Optimizer steps applied to our live slice (set by the engine)."""
        self.usable = True
        """False once a unit is held as per-parameter pieces (``unused``): not copied."""

    def own(self, version: int) -> HeldShard:
        """Our live slice, cloned (its state keys sorted, scalars kept as they are)."""
        units = []
        for unit in self.units:
            state = self.optimizer.state.get(unit.shard, {})
            units.append(
                {
                    "param": unit.shard.detach().clone(),
                    "state": {k: _clone(state[k]) for k in sorted(state)},
                }
            )
        return HeldShard(version, units)

    def exchange(self, version: int, pieces: bool) -> None:
        """Send our slice (at ``version``) to ``rank - 1``, take ``rank + 1``'s; every
        replica calls it at the same point (the end of each optimizer step)."""
        self.version = version
        if self.world < 2:
            return
        if pieces:  # every rank holds the same units as pieces: all stop copying alike
            self.usable, self.copy, self.sent = False, None, None
            return
        mine = self.own(version)
        flat, scalars = _pack(mine)
        got_flat, got_scalars = torch.empty_like(flat), torch.empty_like(scalars)
        left = self._global((self.rank - 1) % self.world)
        right = self._global((self.rank + 1) % self.world)
        ops = [
            dist.P2POp(dist.isend, flat, left, self.group),
            dist.P2POp(dist.isend, scalars, left, self.group),
            dist.P2POp(dist.irecv, got_flat, right, self.group),
            dist.P2POp(dist.irecv, got_scalars, right, self.group),
        ]
        for work in dist.batch_isend_irecv(ops):
            comm.wait(work, "shard copy exchange")
        self.copy = _unpack(mine, got_flat, got_scalars)
        self.sent = mine

    def _global(self, replica_rank: int) -> int:
        return (
            replica_rank if self.group is None else dist.get_global_rank(self.group, replica_rank)
        )

    def held(self, version: int) -> dict[int, list[HeldShard]]:
        """Every slice this worker holds, by replica rank: own live (at ``version``) and
        last sent, and the neighbour's copy."""
        held = {self.rank: [self.own(version)]}
        if self.sent is not None and self.sent.version != version:
            held[self.rank].append(self.sent)
        if self.copy is not None:
            held.setdefault((self.rank + 1) % self.world, []).append(self.copy)
        return held

    def bytes(self) -> int:
        """The copy's and the kept send buffer's bytes (booked under ``optimizer``)."""
        return sum(_held_bytes(h) for h in (self.copy, self.sent) if h is not None)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _elementwise(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _pack(held: HeldShard) -> tuple[torch.Tensor, torch.Tensor]:
    """One flat buffer of the slices (parameter, then elementwise state by key) and one
    float64 vector of the version and the scalar state (a step count is exact there)."""
    flats, scalars = [], [float(held.version)]
    for unit in held.units:
        flats.append(unit["param"].reshape(-1))
        for value in unit["state"].values():
            if _elementwise(value, unit["param"]):
                flats.append(value.reshape(-1).to(unit["param"].dtype))
            else:
                scalars.append(float(value))
    return torch.cat(flats), torch.tensor(scalars, dtype=torch.float64)


def _unpack(like: HeldShard, flat: torch.Tensor, scalars: torch.Tensor) -> HeldShard:
    """The neighbour's slice, laid out as ours (every replica steps the same units with the
    same state keys)."""
    offset, index, units = 0, 1, []
    for unit in like.units:
        param = unit["param"]
        n = param.numel()
        got = {"param": flat[offset : offset + n].clone(), "state": {}}
        offset += n
        for key, value in unit["state"].items():
            if _elementwise(value, param):
                got["state"][key] = flat[offset : offset + n].clone().to(value.dtype)
                offset += n
            elif isinstance(value, torch.Tensor):
                got["state"][key] = torch.tensor(scalars[index].item(), dtype=value.dtype)
                index += 1
            else:
                got["state"][key] = type(value)(scalars[index].item())
                index += 1
        units.append(got)
    return HeldShard(int(scalars[0].item()), units)


def _held_bytes(held: HeldShard) -> int:
    total = 0
    for unit in held.units:
        tensors = [unit["param"], *unit["state"].values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total
