"""The memory ledger: sizes, bookkeeping, the strategy advice, and what engines book."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.parallel.fit_advice import advice, fitting_strategy, model_state_per_worker
from paratrain.parallel.memory_tracking import METER_EVERY, MemoryTracker
from paratrain.runtime.ledger import CATEGORIES, DeviceOutOfMemory, MemoryLedger
from paratrain.runtime.units import format_bytes, parse_size
from tests import mem_workers, workers

GiB, MiB = 1024**3, 1024**2


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        (" 64 kib ", 64 * 1024),
        ("4096", 4096),
        ("4096B", 4096),
        (1024, 1024),
        (None, None),
    ],
)
def test_parse_size_reads_what_users_write(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["2G", "abc", "-1GiB", "0", 0, -5, True, 2.5, "1.5", "2GIBB", ""])
def test_parse_size_refuses_garbage_with_one_sentence(bad):
    with pytest.raises(ValueError) as caught:
        parse_size(bad)
    message = str(caught.value)
    assert message.startswith("memory_per_device must be a size such as '2GiB'")
    assert message.count(".") <= 3 and "\n" not in message


@pytest.mark.parametrize(
    ("count", "text"),
    [(512, "512 B"), (1536, "1.5 KiB"), (1010 * 1024, "1010 KiB"), (3 * GiB, "3 GiB")],
)
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def test_ledger_keeps_current_peak_and_the_peak_of_the_sum():
    ledger = MemoryLedger(worker=3, device=torch.device("cpu"))
    ledger.update(parameters=100, gradients=0)
    ledger.update(activations=500)
    ledger.update(activations=0, gradients=100, optimizer=200)
    expected = {**dict.fromkeys(CATEGORIES, 0), "parameters": 100, "gradients": 100}
    assert ledger.current == {**expected, "optimizer": 200}
    assert ledger.peak["activations"] == 500 and ledger.peak["gradients"] == 100
    assert ledger.total == 400
    assert ledger.peak_total == 600  # params + activations, not the sum of the peaks (900)
    record = ledger.record()
    assert record["worker"] == 3 and "communication" not in record["current"]  # never booked
    with pytest.raises(ValueError, match="unknown memory categories"):
        ledger.update(weights=1)


def test_ledger_overflow_names_worker_category_figures_and_advice():
    seen = []

    def advise(ledger, category):
        seen.append(category)
        return "strategy 'zero2' would fit"

    ledger = MemoryLedger(worker=1, device=torch.device("cpu"), budget=1000, advice=advise)
    ledger.update(parameters=400, gradients=400)
    with pytest.raises(DeviceOutOfMemory) as caught:
        ledger.update(optimizer=300, communication=10)
    error = caught.value
    assert (error.worker, error.category, error.total, error.budget) == (1, "optimizer", 1110, 1000)
    assert seen == ["optimizer"]
    assert str(error) == (
        "worker 1 is out of memory: its optimizer state reached 300 B, bringing its total "
        "to 1.08 KiB (parameters 400 B, gradients 400 B, optimizer state 300 B, communication "
        "buffers 10 B), over the 1000 B budget set by memory_per_device; strategy 'zero2' "
        "would fit."
    )


def test_per_worker_model_state_follows_the_zero_formulas():
    million, n = 1_000_000, 4
    assert model_state_per_worker("dp", million, n) == 16 * million
    assert model_state_per_worker("zero1", million, n) == 10 * million  # 4 + 4 + 8/4
    assert model_state_per_worker("zero2", million, n) == 7 * million  # 4 + 12/4
    assert model_state_per_worker("zero3", million, n) == 4 * million
    assert model_state_per_worker("pipeline", million, n) == 4 * million
    assert model_state_per_worker("ps", million, n) is None


@pytest.mark.parametrize(
    ("budget", "activations", "expected"),
    [
        (17_000_000, 0, "dp"),
        (12_000_000, 0, "zero1"),
        (12_000_000, 3_000_000, "zero2"),
        (5_000_000, 0, "zero3"),
        (3_000_000, 0, None),
    ],
)
def test_fitting_strategy_names_the_least_sharded_that_fits(budget, activations, expected):
    chosen = fitting_strategy(
        parameters=1_000_000, workers=4, budget=budget, activations=activations
    )
    assert chosen == expected


def test_advice_skips_the_running_and_unregistered_strategies():
    sentence = advice(
        parameters=1_000_000,
        workers=4,
        budget=5_000_000,
        candidates=["dp", "pipeline", "single"],
        current="dp",
    )
    assert sentence.startswith("strategy 'pipeline' would fit")
    assert "3.81 MiB per worker" in sentence
    nothing = advice(parameters=1_000_000, workers=4, budget=1_000_000, candidates=["dp"])
    assert nothing.startswith("no strategy fits")


def test_single_engine_books_activations_exactly_and_model_state_after_the_step():
    """Linear -> ReLU -> Linear with an MSE loss saves x, the ReLU output, the prediction
    and the target: 4 * B * (a + b + 2c) bytes; SGD without momentum keeps no state."""
    torch.manual_seed(0)
    batch, a, b, c = 8, 12, 32, 5
    engine = paratrain.setup(
        nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=F.mse_loss,
        strategy="single",
    )
    engine.train_step(torch.randn(batch, a), torch.randn(batch, c))
    record = engine.memory.ledger.record()
    params = 4 * (a * b + b + b * c + c)
    assert record["peak"]["activations"] == 4 * batch * (a + b + 2 * c)
    assert record["current"] == {
        "parameters": params,
        "gradients": params,
        "optimizer": 0,
        "activations": 0,
        "communication": 0,
    }
    assert record["peak_total"] == max(2 * params, params + 4 * batch * (a + b + 2 * c))


def test_ledger_agrees_with_model_state_bytes_under_adam():
    result = mem_workers.run_engine("single", "mlp", "adam", "parity")
    counted = workers.model_state_after_one_step("single", {})
    assert counted["parameters"] > 0
    memory = result["memory"]
    params = sum(v.numel() * 4 for v in result["state"].values())
    assert memory["current"]["parameters"] == memory["current"]["gradients"] == params
    assert params * 2 <= memory["current"]["optimizer"] <= params * 2 + 64 * 8  # + step scalars


def test_metering_samples_the_first_two_steps_and_every_meter_every_after():
    engine = workers.parity_engine("single", "mlp", "sgd")
    tracker = engine.memory
    decisions = [tracker.begin_step(i) for i in range(2 * METER_EVERY + 1)]
    assert [i for i, on in enumerate(decisions) if on] == [0, 1, METER_EVERY, 2 * METER_EVERY]


def test_a_resumed_engine_measures_its_first_step_whatever_its_index(tmp_path):
    """A run resumed at step 3 takes steps 4, 5, ...: its first two steps are measured all
    the same (once, its first was not, and the report showed its gradients and optimizer
    state as 0 B), and so is every METER_EVERY-th step after."""
    x, y = workers.parity_batches("mlp")[0]
    trained = workers.parity_engine("single", "mlp", "adam")
    for _ in range(3):
        trained.train_step(x, y)
    trained.save_checkpoint(tmp_path / "ckpt")
    resumed = workers.parity_engine("single", "mlp", "adam")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.steps_taken == 3
    resumed.train_step(x, y)
    peak = resumed.memory.ledger.record()["peak"]
    assert peak["gradients"] == peak["parameters"] > 0
    assert peak["optimizer"] >= 2 * peak["parameters"] and peak["activations"] > 0
    later = range(4, 2 * METER_EVERY + 1)
    metered = [i for i in later if resumed.memory.begin_step(i)]
    assert metered == [4, METER_EVERY, 2 * METER_EVERY]  # 4: the process's second step


def test_budget_overflow_is_caught_on_the_first_step():
    """A budget above the parameters but below parameters + activations fails at step 1."""
    engine = workers.parity_engine("single", "gpt", "adam")
    x, y = workers.parity_batches("gpt")[0]
    engine.train_step(x, y)
    need = engine.memory.ledger.peak_total
    params = engine.memory.ledger.current["parameters"]
    budget = (params + need) // 2
    tight = workers.parity_engine("single", "gpt", "adam", memory_per_device=budget)
    with pytest.raises(DeviceOutOfMemory) as caught:
        tight.train_step(x, y)
    assert caught.value.category == "activations"
    assert "recompute=True" in str(caught.value)
    assert tight.steps_taken == 0


CUDA_SLACK = 64 * MiB
"""What CUDA libraries allocate through the caching allocator that no tensor of the model
holds (cuBLAS workspaces, the NCCL communicator's buffers): counted by the allocator,
not by the ledger."""


@pytest.mark.gpu
def test_ledger_agrees_with_the_cuda_allocator():
    """After a step the ledger (model state held) is within 5% + CUDA_SLACK of
    ``memory_allocated``. The allocator's peak also holds transients the ledger does not
    book (activation gradients in backward, Adam's temporaries), so it lies between the
    ledger's peak and 1.5 times it (+ CUDA_SLACK)."""
    devices = min(2, torch.cuda.device_count())
    for record in paratrain.launch(mem_workers.gpu_ledger_worker, devices=devices):
        held, allocated = record["total"], record["cuda_allocated"]
        assert abs(held - allocated) <= 0.05 * held + CUDA_SLACK, (held, allocated)
        peak, allocator_peak = record["peak_total"], record["cuda_peak_allocated"]
        assert peak <= allocator_peak + CUDA_SLACK, (peak, allocator_peak)
        assert allocator_peak <= 1.5 * peak + CUDA_SLACK, (peak, allocator_peak)
        assert record["budget"] == record["device_bytes"]  # no budget given: the device's size
        # Adam's two fp32 moments per parameter (21M parameters: 168 MB); the step count is
        # a scalar per tensor. This once said "> 300 MiB", a figure no run could reach,
        # and failed the first time it ran on a GPU (an H200: 168,165,480 B).
        assert record["current"]["optimizer"] >= 8 * record["parameters"]
        assert record["current"]["optimizer"] <= 8 * record["parameters"] + 64 * 1024


def test_a_strategy_without_a_ledger_refuses_a_budget_rather_than_ignore_it(monkeypatch):
    monkeypatch.setattr(MemoryTracker, "watch", lambda self, *args, **kwargs: None)
    with pytest.raises(ValueError, match="strategy 'single' keeps no memory ledger yet"):
        workers.parity_engine("single", "mlp", "sgd", memory_per_device="1GiB")
    workers.parity_engine("single", "mlp", "sgd")  # without a budget it still runs
