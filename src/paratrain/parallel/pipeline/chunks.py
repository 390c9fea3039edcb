"""One worker's chunks of the model: what each virtual stage it runs holds and talks to.

With ``virtual_stages = v`` the layer list is cut into ``p x v`` pieces and piece
``j = c * p + s`` (virtual stage ``j``) lives on stage ``s`` as its chunk ``c``
(Megatron-LM's interleaved layout): a worker holds ``v`` non-adjacent pieces, so that the
interleaved 1F1B schedule (``schedules.interleaved_1f1b``) can divide the bubble by ``v``.
Each chunk has its own link: its activations come from virtual stage ``j - 1`` (stage
``s - 1``, or for ``s = 0`` the last stage's previous chunk) and go to ``j + 1``. The links'
channels are the boundaries' indices, so the chunks' messages between one pair of workers
never meet (``p2p``). With ``v = 1`` there is one chunk, the whole stage, on channel 0:
the messages of plain schedules are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.parallel.pipeline.p2p import StageLink
from paratrain.runtime import comm
from paratrain.runtime.local_p2p import SharedMemoryP2P, connect, wanted
from paratrain.runtime.mesh import Mesh


@dataclass(frozen=True)
class Chunk:
    """One virtual stage on this worker."""

    module: nn.Module
    """Its layers, called one after another (a model cut at named split points: the
    whole model, run to the chunk's boundary)."""
    link: StageLink
    """Its messages with the neighbouring virtual stages."""
    first: bool
    """Virtual stage 0: it takes the batch's inputs."""
    last: bool
    """The last virtual stage: it computes the loss."""
    index: int = 0
    """Its place among this worker's chunks."""


def held_pieces(stage: int, stages: int, chunks: int) -> list[int]:
    """The pieces (virtual stages) stage ``stage`` holds, in chunk order."""
    return [chunk * stages + stage for chunk in range(chunks)]


def chunk_links(mesh: Mesh, device: torch.device, chunks: int, *, window: int) -> list[StageLink]:
    """One link per chunk of this worker (see the module docstring), their messages with
    neighbours on this host through shared memory where the device is the CPU."""
    if chunks == 1:  # the plain pipeline's one link, its tags as they always were
        ends = [
            (None if mesh.is_first else mesh.prev_rank, None if mesh.is_last else mesh.next_rank)
        ]
        channels = [(0, 0)]
    else:
        stages, stage = mesh.stages, mesh.stage
        last = stages * chunks - 1
        pieces = held_pieces(stage, stages, chunks)
        ends = [
            (
                mesh.rank_of((stage - 1) % stages) if piece > 0 else None,
                mesh.rank_of((stage + 1) % stages) if piece < last else None,
            )
            for piece in pieces
        ]
        channels = [(piece, piece + 1) for piece in pieces]
    local = local_transport(device, [rank for pair in ends for rank in pair if rank is not None])
    return [
        StageLink(
            device, prev_rank=prev, next_rank=nxt, window=window, channels=channel, local=local
        )
        for (prev, nxt), channel in zip(ends, channels, strict=True)
    ]


def local_transport(device: torch.device, peers: list[int]) -> SharedMemoryP2P | None:
    """Shared-memory connections with the ``peers`` on this host, for a CPU pipeline
    (``local_p2p``; ``PARATRAIN_P2P=gloo`` keeps gloo's); every peer makes the same call."""
    if device.type != "cpu" or not peers or not wanted():
        return None
    return connect(peers, timeout_s=comm.group_timeout_s())


def build_chunks(modules: list[nn.Module], links: list[StageLink], mesh: Mesh) -> list[Chunk]:
    """This worker's chunks from their modules and links, in chunk order."""
    chunks = len(modules)
    return [
        Chunk(
            module,
            link,
            first=mesh.is_first and index == 0,
            last=mesh.is_last and index == chunks - 1,
            index=index,
        )
        for index, (module, link) in enumerate(zip(modules, links, strict=True))
    ]
