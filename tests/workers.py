"""Worker functions for the multi-process tests.

They live in an importable module (not inside test functions) because spawned workers
import the function by name.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from tests import user_layers


def rank_and_tensor(scale: float) -> dict:
    """Return tensors and plain values so the test can check they come back intact."""
    rank = dist.get_rank()
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "tensor": torch.arange(4, dtype=torch.float64) * scale + rank,
        "threads": torch.get_num_threads(),
    }


def fail_on_rank_one(message: str) -> int:
    """Rank 1 raises; the others block in a collective the failed rank never joins."""
    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.barrier()
    time.sleep(60)
    return dist.get_rank()


def killed_rank_one() -> int:
    """Rank 1 dies without a traceback (as under the OOM killer); others wait."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    time.sleep(60)
    return dist.get_rank()


def write_pid_then_fail(pid_dir: str) -> None:
    """Record the pid, then fail on rank 0 while others sleep, to check nobody is left."""
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == 0:
        raise RuntimeError("planned failure")
    time.sleep(60)


# ---- parity ---------------------------------------------------------------------------

PARITY_STEPS = 10
PARITY_BATCH = 16


def parity_model(kind: str):
    """Small fp32 models without dropout, built identically from a seed."""
    from paratrain.models import build_model

    torch.manual_seed(1234)
    if kind == "mlp":
        return build_model("mlp", in_features=12, hidden=24, depth=2, classes=5)
    if kind == "gpt":
        return build_model("gpt", vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    if kind == "deep":  # 10 layers: enough for 4 stages x 2 virtual stages
        return build_model("mlp", in_features=12, hidden=24, depth=4, classes=5)
    if kind == "unused":
        model = build_model("mlp", in_features=12, hidden=24, depth=1, classes=5)
        model.register_parameter("never_used", torch.nn.Parameter(torch.ones(3)))
        return model
    if kind == "branchy":
        return Branchy()
    if kind == "branchy_layers":  # the same gate as a layer list, for the pipeline
        return torch.nn.Sequential(
            PositiveScale(), GatedBlock(), WithNever(), torch.nn.Linear(24, 5)
        )
    if kind == "late":
        return LateParameter()
    if kind == "frozen":
        return frozen_layers()
    if kind in (*user_layers.KINDS, "wrapped"):
        return user_layers.build(kind)
    raise ValueError(kind)


def frozen_layers() -> torch.nn.Sequential:
    """A layer list a user fine-tunes: the first weight frozen (on the stage fed data),
    a whole Linear frozen between trained ones, and the head's bias frozen
    (``requires_grad=False``: no ``.grad``, so the optimizer never moves them)."""
    widths = [(12, 24), (24, 24), (24, 24), (24, 5)]
    layers: list[torch.nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(widths):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if index < 3 else [])
    model = torch.nn.Sequential(*layers)
    model[0].weight.requires_grad_(False)
    model[4].requires_grad_(False)
    model[6].bias.requires_grad_(False)
    return model


class LateParameter(torch.nn.Module):
    """Two parameters; ``second`` gets its first gradient at step ``LATE_STEP``, when the
    others already hold optimizer state (``late`` batches turn it on from there)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(12, 5) * 0.3)
        self.second = torch.nn.Parameter(torch.randn(12, 5) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.first
        if bool((x[:, 1] > 0).all()):
            out = out + x @ self.second
        return out


LATE_STEP = 3


class GatedBlock(torch.nn.Module):
    """``relu(main(x))``, plus ``branch(x)`` on the samples whose feature 0 is positive.

    ``branch`` runs only where some sample of the (micro-)batch takes it, so a replica
    whose share has no such sample leaves it out of its graph: its parameters are then
    used on some replicas and not on others, while ``main`` always is. As one module it
    is one zero3 unit that mixes used and unused parameters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(12, 24)
        self.branch = torch.nn.Linear(12, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.main(x))
        taken = x[:, 0] > 0
        if bool(taken.any()):
            hidden = hidden + taken.unsqueeze(1) * self.branch(x)
        return hidden


class Branchy(torch.nn.Module):
    """A model whose parameters are not all used at every step (``branchy_batches``).

    ``body.branch`` depends on each sample (``GatedBlock``); ``rare`` runs for the whole
    batch only at steps whose feature 1 is positive (on every replica alike, so zero3's
    gathers stay in step); ``never`` is never used and sits on the root beside ``bias``,
    which always is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = GatedBlock()
        self.head = torch.nn.Linear(24, 5)
        self.rare = torch.nn.Linear(12, 5)
        self.bias = torch.nn.Parameter(torch.zeros(5))
        self.never = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x)) + self.bias
        if bool((x[:, 1] > 0).all()):
            out = out + self.rare(x)
        return out


class PositiveScale(torch.nn.Module):
    """``x`` times a positive per-feature scale: a first layer that keeps each feature's
    sign, so that a gate behind it (on another stage, whose W the zero-bubble schedules
    take unit by unit; the first stage's is one whole backward) sees the batch as made."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.log_scale.exp()


class WithNever(torch.nn.Module):
    """``relu(lin(x))`` beside a parameter the forward never uses: a pipeline stage (or an
    interleaved chunk) holding a parameter that no step gives a gradient."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.never = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


ALL = tuple(range(PARITY_BATCH))
BRANCH_SAMPLES = [(), (0, 1, 2, 3), (), ALL, (12, 13, 14, 15), (), (5, 9), (), ALL, (15,)]
"""Per step, the samples (of 16) that take ``body.branch``: none at all, only the first or
last replica's share, a few samples in the middle, everyone."""
RARE_STEPS = (1, 4, 5, 8)
"""The steps at which every sample runs ``rare``."""


def parity_batches(kind: str, steps: int = PARITY_STEPS, batch: int = PARITY_BATCH):
    """The same global batches on every rank and in the reference."""
    generator = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        if kind == "gpt":
            x = torch.randint(0, 11, (batch, 8), generator=generator)
            y = torch.randint(0, 11, (batch, 8), generator=generator)
        elif kind == "late":
            x = torch.randn(batch, 12, generator=generator)
            y = torch.randint(0, 5, (batch,), generator=generator)
            x[:, 1] = (x[:, 1].abs() + 0.1) * (1 if len(out) >= LATE_STEP else -1)
        elif kind in ("branchy", "branchy_layers"):
            x = torch.randn(batch, 12, generator=generator)
            y = torch.randint(0, 5, (batch,), generator=generator)
            step = len(out)
            x[:, 0] = -x[:, 0].abs() - 0.1
            taken = list(BRANCH_SAMPLES[step % len(BRANCH_SAMPLES)])
            x[taken, 0] = -x[taken, 0]
            x[:, 1] = (x[:, 1].abs() + 0.1) * (1 if step in RARE_STEPS else -1)
        else:
            x = torch.randn(batch, 12, generator=generator)
            y = torch.randint(0, 5, (batch,), generator=generator)
        out.append((x, y))
    return out


def parity_optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "sgd_damped":  # the first step's buffer is the gradient, undamped
        return lambda params: torch.optim.SGD(
            params, lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01, nesterov=False
        )
    if name == "adamw":  # decoupled weight decay: skipped with the step
        return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return lambda params: torch.optim.Adam(params, lr=0.01)


def plain_loop_state(model: torch.nn.Module, optimizer: str, batches, loss_fn) -> dict:
    """``model`` trained by the plain PyTorch loop on ``batches`` (one step each); its
    final state: the reference a user's own loop would reach."""
    step = parity_optimizer(optimizer)(model.parameters())
    for x, y in batches:
        step.zero_grad()
        loss_fn(model(x), y).backward()
        step.step()
    return model.state_dict()


def parity_engine(strategy: str, kind: str, optimizer: str, accumulation: int = 1, **options):
    """The parity model under ``strategy``, built the same way on every rank."""
    import paratrain
    from paratrain.models import loss_for

    return paratrain.setup(
        parity_model(kind),
        optimizer=parity_optimizer(optimizer),
        loss_fn=loss_for("gpt" if kind == "gpt" else "mlp"),
        strategy=strategy,
        gradient_accumulation=accumulation,
        **options,
    )


def train_with(
    strategy: str, kind: str, optimizer: str, accumulation: int, **options
) -> tuple[dict, list[float]]:
    """Train 10 steps with ``strategy``; returns the final state and the reported losses."""
    engine = parity_engine(strategy, kind, optimizer, accumulation, **options)
    losses = [engine.train_step(x, y).loss for x, y in parity_batches(kind)]
    return engine.state_dict(), losses


def dp_parity_worker(cases: list[tuple], options: dict) -> list[tuple[dict, list[float]]]:
    """Run every parity case under dp in one launch (starting workers is the slow part)."""
    return [train_with("dp", *case, **options) for case in cases]


def gpu_dp_parity_worker(cases: list[tuple]) -> list[tuple[dict, list[float]]]:
    """dp on NCCL, one GPU per worker (models and batches move to the worker's GPU)."""
    return [train_with("dp", *case) for case in cases]


def strategies_worker(cases: list[tuple], options: list[dict]) -> list[tuple[dict, list]]:
    """Each case under its own options, the strategy among them (one launch for all)."""
    out = []
    for case, option in zip(cases, options, strict=True):
        settings = dict(option)
        out.append(train_with(settings.pop("strategy"), *case, **settings))
    return out


def pipeline_parity_worker(cases: list[tuple], options: list[dict]) -> list[tuple[dict, list]]:
    """Each case under the pipeline engine with its own options (one launch for all)."""
    return [
        train_with("pipeline", *case, **option) for case, option in zip(cases, options, strict=True)
    ]


def interleaved_worker(
    cases: list[tuple], options: list[dict], loads: list[dict]
) -> list[tuple[dict, list, list[int], int, dict]]:
    """Each case under the pipeline with its options: final state, losses, balance, virtual
    stages in the layout; and the state read back after loading ``loads[i]`` (a state saved
    under another engine) into a fresh engine with the same options."""
    out = []
    for case, option, saved in zip(cases, options, loads, strict=True):
        engine = parity_engine("pipeline", *case, **option)
        losses = [engine.train_step(x, y).loss for x, y in parity_batches(case[0])]
        layout = engine.layout()
        fresh = parity_engine("pipeline", *case, **option)
        fresh.load_state_dict(saved)
        reloaded = fresh.state_dict()
        out.append(
            (engine.state_dict(), losses, layout["balance"], layout["virtual_stages"], reloaded)
        )
    return out


def tensors_left_in_cycles_worker(settings: list[dict]) -> list[int]:
    """Per pipeline setting, the tensors a training step (gpt, SGD) left in reference
    cycles: only Python's cyclic collector frees those, so until it runs they hold memory
    no schedule's arithmetic counts."""
    import gc

    counts = []
    for options in settings:
        engine = parity_engine("pipeline", "gpt", "sgd", **options)
        found = 0
        for x, y in parity_batches("gpt", steps=2):
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
            try:
                engine.train_step(x, y)
                gc.collect()
            finally:
                gc.set_debug(0)
            found += sum(isinstance(item, torch.Tensor) for item in gc.garbage)
            gc.garbage.clear()
        counts.append(found)
    return counts


def activation_peaks_worker(settings: list[dict]) -> list[int]:
    """Peak activation bytes of this stage for each pipeline setting (gpt, 4 steps)."""
    import paratrain
    from paratrain.models import build_model, loss_for

    peaks = []
    for option in settings:
        torch.manual_seed(0)
        model = build_model("gpt", vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=32)
        engine = paratrain.setup(
            model,
            optimizer=parity_optimizer("sgd"),
            loss_fn=loss_for("gpt"),
            strategy="pipeline",
            **option,
        )
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randint(0, 11, (32, 16), generator=generator)
            engine.train_step(x, x)
        peaks.append(engine.activation_peak_bytes())
    return peaks


def varying_length_worker(lengths: tuple[int, ...] = (8, 4, 6)) -> tuple[dict, list[float], list]:
    """Sequence length changes between steps (by default 8, then 4, then 6); also each
    pipeline link's count of rounds whose first activation was posted before its header,
    and of those whose header then differed (``StageLink``)."""
    engine = parity_engine(
        os.environ.get("PARATRAIN_TEST_STRATEGY", "pipeline"),
        "gpt",
        "adam",
        **({"stages": 2, "micro_batches": 4} if dist.is_initialized() else {}),
    )
    losses = [engine.train_step(x, y).loss for x, y in varying_length_batches(lengths)]
    links = [chunk.link for chunk in getattr(engine, "chunks", [])]
    posted = [(link.rounds_posted_ahead, link.guesses_missed) for link in links]
    return engine.state_dict(), losses, posted


def varying_length_batches(lengths: tuple[int, ...] = (8, 4, 6)):
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, 11, (8, length), generator=generator),
            torch.randint(0, 11, (8, length), generator=generator),
        )
        for length in lengths
    ]


def stage_link_rounds_worker(rounds: list) -> dict:
    """Rank 0 sends each round's values (one per micro-batch) over a bare ``StageLink``
    to rank 1, which returns what it received and its link's posting-ahead counts."""
    from paratrain.parallel.pipeline.p2p import StageLink

    rank = dist.get_rank()
    link = StageLink(
        torch.device("cpu"),
        prev_rank=0 if rank == 1 else None,
        next_rank=1 if rank == 0 else None,
        window=2,
    )
    received = []
    for values in rounds:
        link.begin_round(len(values), expect_loss=False)
        for micro, value in enumerate(values):
            if rank == 0:
                link.send_activation(value, micro)
            else:
                received.append(link.recv_activation(micro))
        link.flush()
    return {"received": received, "ahead": link.rounds_posted_ahead, "missed": link.guesses_missed}


def checkpoint_phase(
    strategy: str,
    options: dict,
    kind: str,
    optimizer: str,
    steps: tuple[int, int],
    load_from: str | None,
    save_to: str | None,
) -> tuple[dict, list[float]]:
    """Train steps [start, end) of the parity batches, resuming from and saving checkpoints."""
    engine = parity_engine(strategy, kind, optimizer, **options)
    if load_from:
        engine.load_checkpoint(load_from)
        assert engine.steps_taken == steps[0], (engine.steps_taken, steps)
    start, end = steps
    losses = [engine.train_step(x, y).loss for x, y in parity_batches(kind)[start:end]]
    if save_to:
        engine.save_checkpoint(save_to, metadata={"phase": strategy})
    return engine.state_dict(), losses


def skip_a_collective() -> int:
    """Rank 1 skips the second all-reduce and idles; the others must fail, naming it."""
    from paratrain.runtime import comm

    value = torch.ones(4)
    comm.all_reduce_sum(value)
    if dist.get_rank() != 1:
        comm.all_reduce_sum(value)
    time.sleep(60)
    return dist.get_rank()


def model_state_after_one_step(strategy: str, options: dict) -> dict[str, int]:
    """Model-state bytes a worker holds after one Adam step on a mid-sized mlp."""
    import paratrain
    from paratrain.models import build_model, loss_for

    torch.manual_seed(0)
    engine = paratrain.setup(
        build_model("mlp", in_features=64, hidden=256, depth=2, classes=8),
        optimizer=parity_optimizer("adam"),
        loss_fn=loss_for("mlp"),
        strategy=strategy,
        **options,
    )
    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
    engine.train_step(x, y)
    return engine.model_state_bytes()
