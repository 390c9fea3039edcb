"""``--elastic`` from the survivors' shard copies: the state put together, no checkpoint.

Why a path beside ``run/elastic``'s: there, every survivor holds the whole state and the
furthest one's is broadcast. An engine that keeps each slice of its optimizer state on
one worker plus a copy on its ring neighbour (zero2's ``shard_copies``) offers instead
every slice it holds, with the version of each; all offers are gathered over the new
group and the engine puts the state of the furthest survivor's step together from them
(``held_shards`` / ``load_held_shards``). Where a slice is held by nobody (two ring
neighbours lost) the survivors raise ``ElasticStateLost``, naming themselves, and the
launcher's caller restarts them from the newest checkpoint (``run/elastic_fallback``).

The offers travel as one object all-gather: every survivor sees all the state once, as
rank 0 does when a ZeRO checkpoint is written.
"""

from __future__ import annotations

from typing import Any

from paratrain.runtime import comm

__all__ = ["keeps_copies", "offer", "take_offers"]


def keeps_copies(engine) -> bool:
    """Whether ``engine`` keeps copies of what another worker alone holds."""
    return getattr(engine, "shard_copies", None) is not None


def offer(engine) -> dict[str, Any]:
    """What this survivor holds (before the old engine and its group are dropped)."""
    return engine.held_shards()


def take_offers(engine, own: dict[str, Any], survivors: tuple[int, ...]) -> int:
    """Every member's offer gathered over the new group and loaded into the new engine;
    returns the steps the state has taken (``ElasticStateLost`` if a slice is missing)."""
    offers = comm.all_gather_objects(own)
    return engine.load_held_shards(offers, survivors)
