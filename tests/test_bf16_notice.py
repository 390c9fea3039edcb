"""bf16 on CPU workers whose CPU has no native bf16 says once, before training, what it
costs and which flag trains faster (it once ran zero3 at 10 samples/s with no word).

Whether the CPU is native is measured by a timed probe (``runtime/cpu_bf16``); these tests
fake its answer, since timings are never asserted. Measured by hand on the test machine
(an AVX512-BF16/AMX CPU), with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, what a CPU
without bf16 gets): the probe said 8x, and gpt under zero3 on 2 workers ran 4.5 samples/s
in bf16 against 49.8 in fp32; unrestricted, the probe said 1.0x.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.cli import main
from paratrain.config import TrainConfig
from paratrain.run import precision_notice
from paratrain.run.precision_notice import bf16_notice
from paratrain.runtime.cpu_bf16 import bf16_matmul_slowdown

EMULATED = (
    "paratrain: warning: this CPU has no native bf16 (a bf16 matrix product takes 9x as long "
    "as an fp32 one here), so --precision bf16 runs several times slower than fp32; pass "
    "--precision fp32 to train faster on this machine."
)


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _never() -> float:
    raise AssertionError("the probe ran where no bf16 on a CPU was asked for")


def test_an_emulated_bf16_is_said_with_its_cost_and_the_flag(cpu_only):
    config = TrainConfig(model="mlp", dataset="synthetic", precision="bf16")
    assert bf16_notice(config, 2, slowdown=lambda: 9.0) == EMULATED


def test_no_word_where_bf16_is_native_or_not_asked_for(cpu_only, monkeypatch):
    bf16 = TrainConfig(model="mlp", dataset="synthetic", precision="bf16")
    assert bf16_notice(bf16, 2, slowdown=lambda: 1.1) is None  # native: about as fast
    for precision in ("fp32", "fp16"):
        config = TrainConfig(model="mlp", dataset="synthetic", precision=precision)
        assert bf16_notice(config, 2, slowdown=_never) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU workers (NCCL)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert bf16_notice(bf16, 2, slowdown=_never) is None


def test_the_probe_leaves_the_thread_count_and_the_random_stream_as_they_were():
    threads = torch.get_num_threads()
    state = torch.get_rng_state()
    factor = bf16_matmul_slowdown(size=32, rows=8, repeats=2)
    assert factor > 0
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.slow
def test_train_says_it_once_before_the_run(cpu_only, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(precision_notice, "bf16_matmul_slowdown", lambda: 9.0)
    code = main(
        ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic", "--devices", "1",
         "--steps", "1", "--global-batch", "4", "--hidden", "8", "--depth", "1",
         "--eval-every", "0", "--precision", "bf16", "--run-dir", str(tmp_path / "run")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert [line for line in err.splitlines() if "warning" in line] == [EMULATED]
