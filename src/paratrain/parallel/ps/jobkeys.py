"""Where a parameter-server job keeps its small shared facts: keys on the launch store.

``paratrain.launch`` runs a TCP store in the launching process and tells every worker its
address (``PARATRAIN_STORE``). A ps engine uses it for what is small and rare: the job's
description for the servers, "server j is ready", "server j failed: why", and who writes a
checkpoint. The store lives exactly as long as the launch, which is also how a server
learns that the job is over when no worker could say goodbye.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from paratrain.runtime.hang import STORE_ENV


def connect(address: str | None = None, *, timeout_s: float = 60.0) -> dist.TCPStore:
    """A client of the launch store at ``address`` (default: this worker's launch)."""
    address = address or os.environ.get(STORE_ENV)
    if not address:
        raise RuntimeError(
            "strategy 'ps' needs the store that paratrain.launch starts; call paratrain.setup "
            "inside a function run by paratrain.launch(...)."
        )
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def spec_key(prefix: str) -> str:
    return f"{prefix}/spec"


def ready_key(prefix: str, server: int) -> str:
    return f"{prefix}/ready/{server}"


def error_key(prefix: str, server: int) -> str:
    return f"{prefix}/server_error/{server}"


def group_prefix(prefix: str) -> str:
    return f"{prefix}/group"


def server_error(store: dist.Store, prefix: str, server: int) -> str | None:
    """What server ``server`` said before it stopped, if it said anything."""
    try:
        if store.check([error_key(prefix, server)]):
            return store.get(error_key(prefix, server)).decode()
    except Exception:  # the store is gone too: nothing more to learn
        return None
    return None
