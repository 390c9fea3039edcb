"""Where a ps worker's parameters and gradients live between its pulls and pushes.

Over gloo, a pull arrives as a message that is copied into the model's parameters, and a
push is the gradients packed into a message. With the shared-memory transport (see
``shared_memory``) neither copy is needed: the worker's parameters *are* views of its pull
regions, which each server rewrites in place when the worker pulls, and autograd
accumulates the gradients straight into views of its push regions, which each server
reads when the worker pushes (as DDP's ``gradient_as_bucket_view`` does with its
buckets). The headers order every access: a server writes a pull region only while the
worker waits for that pull's reply and reads a push region only before that push's reply,
so neither side ever touches memory the other is using.

Both keep the engine's contract: a parameter that received no gradient this step (an
unused branch, a frozen weight) is pushed as "no gradient", not as zeros, so the server's
optimizer skips it exactly as a single-device optimizer would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paratrain.parallel.ps.protocol import ShardLayout


class CopiedBuffers:
    """gloo: each pull is copied into the parameters, each push packed from the gradients."""

    def __init__(self, layouts: Sequence[ShardLayout], shards: Sequence[Sequence[nn.Parameter]]):
        self.layouts, self.shards = list(layouts), [list(shard) for shard in shards]
        # Reused every step: a request returns only once gloo is done with its buffers.
        self._received = [layout.empty() for layout in self.layouts]
        self._packed = [layout.empty() for layout in self.layouts]

    def buffer_bytes(self) -> int:
        """Bytes of the receive and pack buffers: copies beside the parameters and grads."""
        flats = [t for group in (*self._received, *self._packed) for t in group]
        return sum(t.numel() * t.element_size() for t in flats)

    def pull_payloads(self) -> list[list[torch.Tensor]] | None:
        """Receive buffers for each server's reply to a pull."""
        return self._received

    @torch.no_grad()
    def take_pull(self) -> None:
        for layout, shard, flats in zip(self.layouts, self.shards, self._received, strict=True):
            for param, value in zip(shard, layout.views(flats), strict=True):
                param.copy_(value)

    def clear_grads(self) -> None:
        for shard in self.shards:
            for param in shard:
                param.grad = None

    def has_grad(self) -> list[list[bool]]:
        return [[param.grad is not None for param in shard] for shard in self.shards]

    def push_payloads(self) -> list[list[torch.Tensor]] | None:
        """Each server's share of the gradients, packed (no gradient packs as zeros)."""
        return [
            layout.pack([p.grad for p in shard], out=out)
            for layout, shard, out in zip(self.layouts, self.shards, self._packed, strict=True)
        ]


class MappedBuffers:
    """Shared memory: parameters live in the pull regions, gradients in the push regions."""

    def __init__(
        self,
        layouts: Sequence[ShardLayout],
        shards: Sequence[Sequence[nn.Parameter]],
        pull_flats: Sequence[list[torch.Tensor]],
        push_flats: Sequence[list[torch.Tensor]],
    ) -> None:
        self.shards = [list(shard) for shard in shards]
        self._push_flats = list(push_flats)
        self._grad_views = [
            layout.views(flats) for layout, flats in zip(layouts, push_flats, strict=True)
        ]
        self._received: set[int] = set()  # ids of parameters that got a gradient this step
        with torch.no_grad():
            for layout, shard, flats in zip(layouts, self.shards, pull_flats, strict=True):
                for param, view in zip(shard, layout.views(flats), strict=True):
                    view.copy_(param)
                    param.data = view  # the same Parameter object, now in the region
        for shard in self.shards:
            for param in shard:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._note_gradient)

    def _note_gradient(self, param: torch.Tensor) -> None:
        self._received.add(id(param))

    def buffer_bytes(self) -> int:
        """None beside the parameters and gradients: the regions are where they live."""
        return 0

    def pull_payloads(self) -> None:
        return None  # the servers write the parameters in place

    def take_pull(self) -> None:
        pass

    def clear_grads(self) -> None:
        """Zeroed region views as ``.grad``: backward adds into them in place."""
        for flats in self._push_flats:
            for flat in flats:
                flat.zero_()
        for shard, views in zip(self.shards, self._grad_views, strict=True):
            for param, view in zip(shard, views, strict=True):
                param.grad = view if param.requires_grad else None
        self._received.clear()

    def has_grad(self) -> list[list[bool]]:
        return [[id(param) in self._received for param in shard] for shard in self.shards]

    def push_payloads(self) -> None:
        return None  # the servers read the gradients where backward left them
