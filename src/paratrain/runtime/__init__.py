"""Processes and devices: nothing here knows about models."""

import paratrain.runtime.parent_death  # noqa: F401 - first, before torch loads (see there)
from paratrain.runtime.devices import current_device, peak_memory_bytes
from paratrain.runtime.external_job import is_main_process
from paratrain.runtime.launch import WorkerError, launch

__all__ = ["WorkerError", "current_device", "is_main_process", "launch", "peak_memory_bytes"]
