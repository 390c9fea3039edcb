"""Names that wrapper modules add, and a checkpoint read under the loading model's names.

``torch.compile`` wraps a model (or a layer) in an ``OptimizedModule`` whose tensors are
named ``_orig_mod.<name>``; FSDP's and activation checkpointing's wrappers add their own
segments the same way. The same model with and without the wrapper is one model, and a
run resumed with ``torch.compile`` turned on or off (or compiled layer by layer instead
of whole) must load its checkpoint: the names of a checkpoint that differ from the
loading model's only by such segments are read under the model's own
(``renaming_for``), its optimizer state included, where before the load refused it as
"saved from a different model".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

ANYWHERE_WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Wrapper segments that may wrap any submodule; no user names a module like these."""


def without_wrappers(name: str) -> str:
    """``name`` without the segments listed in ``ANYWHERE_WRAPPERS``."""
    parts = name.split(".")
    kept = [part for part in parts if part not in ANYWHERE_WRAPPERS]
    return name if len(kept) == len(parts) else ".".join(kept)


def renaming_for(local_names: Iterable[str]) -> Callable[[str], str]:
    """A stored name -> the loading model's name for the same tensor: the local name with
    the same name once wrappers are left out, else the stored name itself. Optimizer
    tensors are named ``<parameter>/<state key>``; their parameter part is renamed."""
    own = {without_wrappers(name): name for name in local_names}

    def rename(stored: str) -> str:
        head, slash, tail = stored.partition("/")
        return own.get(without_wrappers(head), head) + slash + tail

    return rename
