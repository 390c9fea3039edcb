"""torch.compile'd regions under a split backward (the zero-bubble schedules).

Why: AOTAutograd compiles a region's backward with "donated buffers" (saved activations
whose memory that backward reuses for its own results), which is safe only where the
backward runs once, so it raises under ``retain_graph=True``. B keeps each layer's graph
for W (``split_backward``), so a stage holding a compiled region (``torch.compile(layer)``,
``layer.compile()``, a compiled function inside ``forward``) failed at its first B under
ZB-H1 or ZB-H2, deep inside torch. A compiled region's backward is one autograd node that
makes its input and weight gradients together: B runs it, W runs it again for the weights,
which is exact once nothing it saved was overwritten. So a worker whose schedule splits the
backward turns donated buffers off before its stage's first forward compiles anything
(``keep_compiled_graphs_for_w``; the region's saved activations then live until W, as an
uncompiled layer's do). A region compiled before that, with them on (a forward run before
``paratrain.setup``), still raises: ``explained`` says what to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_TORCH_SAYS = "donated buffer"


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
    """Re-raise torch's donated-buffer error of a split backward as what to change."""
    try:
        yield
    except RuntimeError as error:
        if _TORCH_SAYS not in str(error):
            raise
        raise RuntimeError(
            "A torch.compile'd region of this stage was compiled with donated buffers, so "
            "its backward cannot run twice as the zero-bubble schedules' B and W do: set "
            "torch._functorch.config.donated_buffer = False before the model's first "
            "forward (paratrain.setup does so for later compiles), or pick "
            "schedule='1f1b' or 'interleaved'."
        ) from error
