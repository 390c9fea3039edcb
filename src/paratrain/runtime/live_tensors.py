"""An independent count of the memory a worker holds: every tensor storage alive, peak.

Why a count of our own: the engines' ledger books what they are told at fixed points, so a
planner predicting the ledger only agrees with itself. What runs a device out of memory
is live storages (on a GPU, what the caching allocator hands out), at any instant,
temporaries included. PyTorch's own ``MemTracker`` counts them too, but it refuses a
module called several times per step (the pipeline's micro-batches); this count does not
look at modules at all.

How: a ``TorchDispatchMode`` sees every operator's outputs, in the thread that runs it
(CPU backward runs in the caller's thread). Each new storage is booked with its bytes and
a weak reference whose callback books its release, so the count is exact at every
operator boundary; the peak is the highest sum. ``UntypedStorage.resize_`` (ZeRO-3's
gather and free) bypasses the dispatcher, so it is wrapped while the count runs, as
``MemTracker`` does. A storage made before the count starts is booked from the first
operator whose output it backs (a view of the batch, an in-place update), not before:
enter the count before the model is built.

Where a prediction and the count disagree, ``LiveTensors(trace=True)`` says where the
storages alive at the peak were made (``at_peak``: bytes by the operator and the first
frame outside torch that made them); it costs a stack walk per storage, so it is for
finding what a prediction leaves out, not for measuring.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    """Bytes of tensor storages alive now (``current``) and at most (``peak``).

    Use as a context manager around the model's construction and the steps::

        with LiveTensors() as live:
            engine = paratrain.setup(build_model(), ...)
            for x, y in batches: engine.train_step(x, y)
        live.peak
    """

    def __init__(self, *, trace: bool = False) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._excluded: dict[int, torch.UntypedStorage] = {}
        self._original_resize: Any = None
        self._trace = trace
        self._sites: dict[int, str] = {}
        self._at_peak: dict[int, int] = {}
        self._peak_sites: dict[int, str] = {}
        self._op = "resize_"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func.__name__)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._see(leaf.untyped_storage())
        if func is torch.ops.aten.set_.source_Storage or func.__name__.startswith("resize"):
            for leaf in tree_leaves(args):
                if isinstance(leaf, torch.Tensor):
                    self._see(leaf.untyped_storage())
        self._op = "resize_"
        return out

    def at_peak(self, top: int = 20) -> list[tuple[int, str]]:
        """(bytes, where made) of the storages alive at the peak, largest first, summed by
        place (``trace=True`` only): what a prediction that falls short left out."""
        if not self._trace:
            raise ValueError("at_peak needs LiveTensors(trace=True): nothing was traced.")
        by_site: Counter[str] = Counter()
        for key, size in self._at_peak.items():
            by_site[self._peak_sites.get(key, "?")] += size
        return [(size, site) for site, size in by_site.most_common(top)]

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count the storages behind ``tensors`` (what existed before a measurement,
        such as a layer's parameters and recorded input, whose views it will make)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._excluded[id(storage)] = storage  # held: its id is not reused meanwhile

    def _see(self, storage: torch.UntypedStorage) -> None:
        """Book ``storage`` if new, or its new size if it changed."""
        key = id(storage)
        if storage.device.type == "meta" or key in self._excluded:
            return
        size = storage.nbytes()
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._bytes[key] = 0
            if self._trace:
                self._sites[key] = _site(self._op)
        self._book(key, size)

    def _book(self, key: int, size: int) -> None:
        self.current += size - self._bytes[key]
        self._bytes[key] = size
        if self.current > self.peak:
            self.peak = self.current
            if self._trace:
                self._at_peak = dict(self._bytes)
                self._peak_sites = dict(self._sites)

    def _free(self, key: int) -> None:
        self.current -= self._bytes.pop(key, 0)
        self._refs.pop(key, None)
        self._sites.pop(key, None)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.current
        if self._trace:
            self._at_peak, self._peak_sites = dict(self._bytes), dict(self._sites)

    def __enter__(self) -> LiveTensors:
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._see(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]


def _site(op: str) -> str:
    """``op`` and the innermost frame outside torch and this module that led to it."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename
        if "/torch/" not in path and path != __file__:
            where = "/".join(path.split("/")[-2:])
            return f"{op} at {where}:{frame.lineno} {frame.name}"
    return op
