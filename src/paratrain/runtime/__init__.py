"""Processes and devices: nothing here knows about models."""

from paratrain.runtime.devices import current_device, peak_memory_bytes
from paratrain.runtime.launch import WorkerError, launch

__all__ = ["WorkerError", "current_device", "launch", "peak_memory_bytes"]
