"""Tensor parallelism: the plan (which layers split how), the split layers with Megatron's
f/g operators, canonical checkpoints, and the ``tp`` engine (``engine`` registers it)."""

from paratrain.parallel.tp import engine  # noqa: F401  (registration)
