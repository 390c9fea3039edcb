"""A device's own out-of-memory error reaches the user as the ledger's one sentence."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paratrain.runtime.device_oom import device_errors_told
from paratrain.runtime.ledger import DeviceOutOfMemory, MemoryLedger

MiB = 2**20
ALLOCATOR = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.06 GiB is free. Of the allocated memory 76.10 GiB is allocated by PyTorch"
)


def _ledger(advice=None) -> MemoryLedger:
    ledger = MemoryLedger(worker=1, device=torch.device("cpu"), advice=advice)
    ledger.update(parameters=40 * MiB, optimizer=80 * MiB, activations=300 * MiB)
    return ledger


def test_a_cuda_out_of_memory_becomes_the_ledgers_sentence():
    """The allocator's request size and the ledger's categories in one sentence; the culprit
    named is the largest category, and the adviser's clause closes it."""
    ledger = _ledger(advice=lambda _, category: f"{category} would fit with recompute=True")
    with pytest.raises(DeviceOutOfMemory) as caught, device_errors_told(ledger):
        raise torch.cuda.OutOfMemoryError(ALLOCATOR)
    sentence = str(caught.value)
    assert sentence.startswith("worker 1 ran out of memory on cpu when an allocation of 2.00 GiB")
    assert "parameters 40 MiB" in sentence and "activations saved for backward 300" in sentence
    assert sentence.endswith("activations would fit with recompute=True.")
    assert caught.value.category == "activations" and "\n" not in sentence


def test_without_an_adviser_the_sentence_still_says_what_to_change():
    with pytest.raises(DeviceOutOfMemory, match="use a smaller batch, recompute=True or zero3"):
        with device_errors_told(_ledger()):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")


def test_other_errors_pass_through_untouched():
    with pytest.raises(ValueError, match="not memory"), device_errors_told(_ledger()):
        raise ValueError("not memory")


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_ends_the_cli_run_in_one_sentence(tmp_path):
    """A batch whose activations cannot fit on the GPU (512 x 1024 tokens x 2048 wide: one
    fp32 activation is 4 GiB, a layer saves over ten): the command ends with the ledger's
    sentence (the allocator's figures beside the ledger's), not a worker traceback."""
    command = [
        sys.executable, "-m", "paratrain", "train", "--model", "gpt",
        "--dataset", "synthetic_tokens",
        "--n-embd", "2048", "--n-layer", "16", "--n-head", "16", "--block-size", "1024",
        "--global-batch", "512", "--steps", "2", "--no-progress", "--run-dir",
        str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "ran out of memory on cuda:0" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
