"""Files paratrain writes get the permissions the user's umask gives any new file.

safetensors' ``save_file`` (like ``tempfile.mkstemp``) creates its file with mode 0600
whatever the umask, so a checkpoint written on a shared cluster would be unreadable to
teammates although ``open()`` would have made it 0644. Every shard and export is passed
through ``match_umask`` after it is written.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux
    ``/proc/self/status``); elsewhere set and restored at once under a lock."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def match_umask(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would have given it (0666 less
    the umask)."""
    os.chmod(path, 0o666 & ~current_umask())
