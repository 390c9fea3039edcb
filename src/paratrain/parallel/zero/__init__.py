"""``strategy="zero1" | "zero2" | "zero3"``: ZeRO, model state sharded over the replicas.

description.py the three strategies before any worker starts (options, memory, costs)
engine.py      the three engines (what they share, then one class per stage)
cost.py        the planner's time and memory model
shards.py      FlatUnit: a padded flat buffer per unit, an exact 1/N slice per rank
grads.py       reduce-scatter of each unit's gradients as backward completes it
gather.py      zero3: gather a unit before its forward and backward, free after
checkpoint.py  zero state to and from the canonical checkpoint format
optim.py       which optimizers may be handed flat slices (elementwise ones)
"""

from paratrain.parallel.zero.description import Zero1Strategy, Zero2Strategy, Zero3Strategy
from paratrain.parallel.zero.engine import Zero1Engine, Zero2Engine, Zero3Engine, ZeroEngine

__all__ = [
    "Zero1Engine",
    "Zero1Strategy",
    "Zero2Engine",
    "Zero2Strategy",
    "Zero3Engine",
    "Zero3Strategy",
    "ZeroEngine",
]
