"""What a split backward (the zero-bubble schedules' B, then W) asks of torch that some
users' code cannot give, made to work where it can be and explained where it cannot.

B keeps each layer's graph for W (``retain_graph``) and asks ``torch.autograd.grad`` for
its inputs' gradients alone; W runs the graph again towards the weights. Two kinds of
user code refuse that, deep inside torch:

- A torch.compile'd region (``torch.compile(layer)``, ``layer.compile()``, a compiled
  function inside ``forward``): AOTAutograd compiles its backward with "donated buffers"
  (saved activations whose memory that backward reuses for its own results), safe only
  where the backward runs once, so it raises under ``retain_graph``. Its backward is one
  autograd node that makes input and weight gradients together: B runs it and W runs it
  again, which is exact once nothing it saved was overwritten. So a worker whose schedule
  splits the backward turns donated buffers off before its stage's first forward compiles
  anything (``keep_compiled_graphs_for_w``; the region's saved activations then live until
  W, as an uncompiled layer's do). A region compiled before that with them on (a forward
  run before ``paratrain.setup``) still raises.
- ``torch.utils.checkpoint`` with ``use_reentrant=True`` (the default of Hugging Face's
  ``gradient_checkpointing_enable()`` in its 4.x releases; 5.x defaults to False): its
  backward reruns the forward and calls a whole backward of its own, which torch allows
  only from a plain ``.backward()`` without ``inputs``, never from ``autograd.grad``.
  ``use_reentrant=False`` splits exactly (tests/test_user_checkpoint.py).

``explained`` turns either error into one sentence that says what to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_DONATED = "donated buffer"
_REENTRANT = "compatible with .grad()"  # torch 2.4 "not compatible", later "incompatible"


def keep_compiled_graphs_for_w() -> None:
    """Compile regions' backwards so that they can run twice (B, then W). A setting of the
    worker's process, read when a region compiles; torch before 2.5 has no such buffers."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # pragma: no cover - torch without functorch's config
        return
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False


@contextmanager
def explained() -> Iterator[None]:
    """Re-raise torch's errors of a split backward that user code causes as what to
    change (see the module docstring)."""
    try:
        yield
    except RuntimeError as error:
        said = str(error)
        if _DONATED in said:
            raise RuntimeError(
                "A torch.compile'd region of this stage was compiled with donated buffers, "
                "so its backward cannot run twice as the zero-bubble schedules' B and W do: "
                "set torch._functorch.config.donated_buffer = False before the model's "
                "first forward (paratrain.setup does so for later compiles), or pick "
                "schedule='1f1b' or 'interleaved'."
            ) from error
        if _REENTRANT in said:
            raise RuntimeError(
                "A layer of this stage runs torch.utils.checkpoint with use_reentrant=True, "
                "whose backward cannot be split into the zero-bubble schedules' B and W: "
                "pass use_reentrant=False (Hugging Face: {'use_reentrant': False} as the "
                "checkpointing kwargs of gradient_checkpointing_enable), or recompute "
                "with paratrain's recompute=True instead, or pick schedule='1f1b' or "
                "'interleaved'."
            ) from error
        raise
