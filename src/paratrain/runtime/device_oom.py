"""A real out-of-memory error of the device, told as the ledger's budget error is told.

The ledger refuses a step that goes over ``memory_per_device`` with one sentence that names
what grew and what to change. A GPU can run out before the ledger's budget does (another
process holds memory, the allocator's slack and fragmentation, a kernel's workspace the
ledger cannot see), and PyTorch then raises ``torch.cuda.OutOfMemoryError`` with the
allocator's numbers but nothing about the run. This turns that error into the same
``DeviceOutOfMemory`` sentence, with the allocator's figures and the ledger's categories
side by side, so the CLI prints one sentence either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from paratrain.runtime.ledger import CATEGORIES, LABELS, DeviceOutOfMemory, MemoryLedger
from paratrain.runtime.units import format_bytes

_REQUEST = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)")


@contextmanager
def device_errors_told(ledger: MemoryLedger) -> Iterator[None]:
    """Run the block; a CUDA out-of-memory error inside it becomes ``DeviceOutOfMemory``."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        raise out_of_memory_sentence(ledger, str(error)) from None


def out_of_memory_sentence(ledger: MemoryLedger, allocator_message: str) -> DeviceOutOfMemory:
    """The one sentence for an allocation the device refused (see the module's docstring)."""
    device = ledger.device
    held = ""
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        held = (
            f" ({torch.cuda.get_device_name(device)}, {format_bytes(total)}): PyTorch held "
            f"{format_bytes(torch.cuda.memory_reserved(device))} of it"
        )
    found = _REQUEST.search(allocator_message)
    request = f" when an allocation of {found.group(1)} failed" if found else ""
    booked = [c for c in CATEGORIES if ledger.current[c]]
    breakdown = ", ".join(f"{LABELS[c]} {format_bytes(ledger.current[c])}" for c in booked)
    largest = max(booked, key=lambda c: ledger.current[c]) if booked else "activations"
    advice = ledger.advice(largest)
    message = (
        f"worker {ledger.worker} ran out of memory on {device}{held}{request}; its ledger "
        f"counted {breakdown or 'nothing yet'}"
        + (f"; {advice}." if advice else "; use a smaller batch, recompute=True or zero3.")
    )
    return DeviceOutOfMemory(
        message,
        worker=ledger.worker,
        category=largest,
        total=ledger.total,
        budget=ledger.budget or 0,
    )
