"""``strategy="tp"``'s engine: tensor parallelism (Megatron-LM's), dp whose layers split
over every worker unless ``tensor`` says fewer.

Every worker holds its slice of each split layer and the whole of everything else
(LayerNorms, embeddings not split, rowwise biases), and runs forward and backward on its
replica's share of the global batch: the split layers' ``f``/``g`` operators make every
replicated activation, and so every replicated gradient, whole and equal on the members of
a tensor group, so nothing is all-reduced for them and nothing is counted twice. A
colwise/rowwise pair costs one all-reduce of its output forward and one of its input's
gradient backward. With ``tensor`` below the worker count the workers form ``replicas x
tensor`` (tensor innermost) and the replicas average gradients as dp does: this is dp's
engine; the tensor degree's default, the only difference, is the description's
(``dp/description.py``).
"""

from __future__ import annotations

from paratrain.parallel.dp.engine import DataParallelEngine


class TensorParallelEngine(DataParallelEngine):
    """dp's engine under its own name (``tp``): its layout carries the tensor degree."""
