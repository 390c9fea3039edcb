"""paratrain: train one PyTorch model on several devices, under one small API.

engine = paratrain.setup(model, optimizer=..., loss_fn=..., strategy="dp")
results = paratrain.launch(worker, devices=4)
best = paratrain.plan(model, devices=4, global_batch=64, memory_per_device="16GiB", ...)
"""

import paratrain.runtime  # noqa: F401 - first: a launched worker dies with its launcher
from paratrain.api import setup
from paratrain.checkpoints.format import CheckpointError
from paratrain.checkpoints.model_state import load_model_state
from paratrain.parallel import BatchSplitError, Engine, StepStats, strategy_names
from paratrain.planner import NoPlanFits, Plan, plan, predict
from paratrain.runtime import WorkerError, is_main_process, launch
from paratrain.runtime.ledger import DeviceOutOfMemory

__version__ = "0.1.0"

__all__ = [
    "BatchSplitError",
    "Engine",
    "StepStats",
    "CheckpointError",
    "DeviceOutOfMemory",
    "WorkerError",
    "is_main_process",
    "launch",
    "load_model_state",
    "NoPlanFits",
    "Plan",
    "plan",
    "predict",
    "setup",
    "strategy_names",
]
