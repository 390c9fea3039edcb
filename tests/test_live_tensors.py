"""The independent count of live memory (``runtime/live_tensors``) against two witnesses
we did not write: PyTorch's ``MemTracker`` and a plain loop's bytes worked out by hand.

Pure single-process tests (a second each); the planner's predictions are held against the
count in ``test_planner.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.runtime.live_tensors import LiveTensors

BATCH, IN, HIDDEN, OUT = 64, 256, 512, 10


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, steps: int, each=None):
    for _ in range(steps):
        if each is not None:
            each()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_a_plain_loop_peaks_at_the_bytes_worked_out_by_hand():
    """Adam (per-tensor loop) on a 2-layer MLP peaks in its step: parameters, gradients and
    two moments (4P), the batch, four 4-byte ``step`` counters, and the step's two
    temporaries of the largest weight (``exp_avg_sq.sqrt()`` and its quotient by the bias
    correction, 256 x 512 fp32 each). Backward holds less: 3P and the activations (the
    hidden layer's 64 x 512 output and the logits, under 0.3 MB), against the step's 1 MiB
    of temporaries. After the steps the temporaries are gone: 4P, the batch, the steps."""
    with LiveTensors() as live:
        x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        _train(model, optimizer, x, y, steps=3)
    params = 4 * (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT)
    batch = BATCH * IN * 4 + BATCH * 8
    held = 4 * params + batch + 4 * 4
    assert live.current == held
    assert live.peak == held + 2 * IN * HIDDEN * 4


def test_the_count_agrees_with_pytorchs_memtracker():
    """``MemTracker`` counts the same storages on a model it can follow (each module called
    once per step): the peaks agree to the byte. The batch is made before either count
    starts and only read, so neither sees it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
    with LiveTensors() as live:
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        _train(model, optimizer, x, y, steps=3)
    tracker = MemTracker()
    with tracker:
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        tracker.track_external(model, optimizer)
        _train(model, optimizer, x, y, steps=3, each=tracker.reset_mod_stats)
    tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert live.peak == tracked


def test_a_module_called_several_times_and_storages_resized_are_followed():
    """What ``MemTracker`` refuses (one layer called twice in a step, as a pipeline stage
    runs its micro-batches) and what the dispatcher does not see (``resize_``, ZeRO-3's
    free) are counted: a freed storage leaves the count, a regrown one comes back."""
    with LiveTensors() as live:
        layer = nn.Linear(IN, IN)
        for _ in range(2):
            layer(torch.randn(BATCH, IN)).sum().backward()
        grown = live.current
        buffer = torch.zeros(1000)
        buffer.untyped_storage().resize_(0)
        assert live.current == grown
        buffer.untyped_storage().resize_(4000)
        assert live.current == grown + 4000
    assert grown == 2 * 4 * (IN * IN + IN)  # weights, bias and their gradients
    assert live.peak >= grown + 2 * BATCH * IN * 4  # an input and an output at least


def test_a_traced_count_names_where_the_peaks_storages_were_made():
    """``trace=True`` keeps, for the storages alive at the peak, the operator and the
    frame that made them: the 1 MiB temporary made on a known line is there, with its
    bytes, and the peak is the same as without the trace."""

    def step(x):
        wide = torch.zeros(1 << 18)  # 1 MiB, alive at the peak only
        return (x * 2).sum() + wide.sum()

    x = torch.randn(BATCH, IN)
    with LiveTensors() as plain:
        step(x)
    with LiveTensors(trace=True) as traced:
        step(x)
    assert traced.peak == plain.peak
    sizes = dict((site, size) for size, site in traced.at_peak())
    made_here = [site for site in sizes if site.startswith("zeros.default at ") and "step" in site]
    assert made_here and sizes[made_here[0]] == 4 << 18
    assert sum(sizes.values()) == traced.peak
    with pytest.raises(ValueError, match="trace=True"):
        plain.at_peak()
