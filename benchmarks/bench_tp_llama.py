"""Hugging Face's Llama split by paratrain ``tp`` against PyTorch's ``parallelize_module``.

The same ``LlamaForCausalLM`` (tiny-to-small: hidden 256, 4 query heads, 2 key-value
heads, SwiGLU 688, 2 layers, sequence 128) is built twice in every worker of one launch:
paratrain ``strategy="tp"`` with Hugging Face's own plan for Llama written out (q, k, v,
gate, up colwise; o, down rowwise), and PyTorch's ``parallelize_module`` on each decoder
layer with ``ColwiseParallel``/``RowwiseParallel`` on the same plan, the way torchtitan
splits Llama (DTensor over a 1-D CPU mesh on gloo, local outputs). torchtitan sets each
attention's head counts to the rank's share; Hugging Face's attention reshapes by
``head_dim`` with ``-1`` heads and keeps only ``num_key_value_groups`` (4 / 2 on every
rank, unchanged), so the counts are set where the module has them. Embedding, norms and
head stay whole on both sides.

Both sides run the whole batch on every worker, Adam as a user writes it, the token-mean
loss, and alternate round by round on the same batches (``alternation``). The first
step's losses are printed side by side (the same function from the same weights). Peak
memory per worker is measured by PyTorch's own ``MemTracker`` (``torch.distributed.
_tools.mem_tracker``, which counts every tensor allocated under it: parameters,
gradients, optimizer state, activations, temporaries) over one step of each side after
the timed rounds; the ratios are paratrain / torch for memory (<= 1: paratrain at most
torch's) and torch / paratrain for time (>= 1: paratrain at least as fast).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from alternation import median_step_times, over_launches, slowest_rank

import paratrain
from paratrain.losses import causal_lm_cross_entropy

LLAMA = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
LENGTH, BATCH = 128, 8
PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""Per decoder layer: Hugging Face's ``base_model_tp_plan`` for Llama, torchtitan's cut."""


def build_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


def make_batches(count: int) -> list[tuple[dict, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, LLAMA["vocab_size"], (BATCH, LENGTH), generator=generator)
        out.append(({"input_ids": ids}, ids))
    return out


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


class TorchLlama:
    """``parallelize_module`` on each decoder layer with the plan's torch styles."""

    def __init__(self, tensor: int, fused: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        self.model = build_llama()
        mesh = init_device_mesh("cpu", (tensor,))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {name: styles[kind]() for name, kind in PLAN.items()}
        for layer in self.model.model.layers:
            attention = layer.self_attn
            for count in ("num_heads", "num_key_value_heads"):  # torchtitan's per-rank counts
                if isinstance(getattr(attention, count, None), int):
                    setattr(attention, count, getattr(attention, count) // tensor)
            parallelize_module(layer, mesh, plan)
        self.optimizers = fused_adams(self.model) if fused else [adam(self.model.parameters())]
        self.losses: list[float] = []

    def state(self) -> tuple:
        return self.model, *self.optimizers

    def step(self, inputs: dict, labels: torch.Tensor) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        total, count = causal_lm_cross_entropy(self.model(**inputs), labels)
        loss = total / count
        loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()
        self.losses.append(float(loss.detach()))


def fused_adams(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's fused Adam, one over the DTensor parameters and one over the plain ones:
    one fused call over both is refused by torch ("got mixed torch.Tensor and DTensor")."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)]]
    groups.append([p for p in params if not isinstance(p, DTensor)])
    return [torch.optim.Adam(group, lr=1e-4, fused=True) for group in groups if group]


class ParatrainLlama:
    def __init__(self, tensor: int) -> None:
        self.engine = paratrain.setup(
            build_llama(),
            optimizer=adam,
            loss_fn=causal_lm_cross_entropy,
            strategy="tp",
            tensor=tensor,
            tp_plan={f"model.layers.*.{name}": kind for name, kind in PLAN.items()},
        )
        self.losses: list[float] = []

    def state(self) -> tuple:
        return self.engine.model, self.engine.optimizer

    def step(self, inputs: dict, labels: torch.Tensor) -> None:
        self.losses.append(self.engine.train_step(inputs, labels).loss)


def peak_bytes(runner, batch: tuple) -> int:
    """PyTorch's ``MemTracker`` over one step: the peak of the model's parameters and the
    optimizer's state (registered before the step, as they exist already) and every tensor
    the step allocates."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*runner.state())  # else a tensor counts from its first use on
    with tracker:
        runner.step(*batch)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def llama_worker(rounds: int, steps: int, warmup: int, fused: bool) -> dict:
    """``fused``: the torch side asks for torch's fused Adam, the kernel paratrain builds
    where the factory leaves it to torch (so that only the split differs)."""
    tensor = dist.get_world_size()
    ours, theirs = ParatrainLlama(tensor), TorchLlama(tensor, fused)
    batches = make_batches(steps)
    ours.step(*batches[0])  # the same first step from the same weights: the same loss
    theirs.step(*batches[0])
    first = {"paratrain": ours.losses[0], "torch": theirs.losses[0]}
    runners = {"torch": theirs, "paratrain": ours}
    medians = median_step_times(runners, batches, rounds=rounds, warmup=warmup)
    peaks = {key: peak_bytes(runner, batches[0]) for key, runner in runners.items()}
    return {"median_s": medians, "peak_bytes": peaks, "first_loss": first}


def run_llama(tensor: int, rounds: int, steps: int, repeats: int, fused: bool = False) -> dict:
    """``repeats`` launches; medians over steps, then launches; the slowest rank's time
    and the largest worker's peak."""
    launches = [
        paratrain.launch(llama_worker, devices=tensor, args=(rounds, steps, 2, fused))
        for _ in range(repeats)
    ]
    timed = [slowest_rank([r["median_s"] for r in results]) for results in launches]
    median, ratios = over_launches(timed, ours="paratrain", peer="torch")
    peaks = [slowest_rank([r["peak_bytes"] for r in results]) for results in launches]
    memory = [p["paratrain"] / p["torch"] for p in peaks]
    return {
        "tensor": tensor,
        "median_step_s": median,
        "samples_per_s": {key: BATCH / value for key, value in median.items()},
        "speed_ratio": statistics.median(ratios),
        "speed_range": [min(ratios), max(ratios)],
        "peak_bytes": {key: statistics.median(p[key] for p in peaks) for key in peaks[0]},
        "memory_ratio": statistics.median(memory),
        "memory_range": [min(memory), max(memory)],
        "first_loss": launches[0][0]["first_loss"],
    }


LLAMA_HEADER = (
    "| tensor | torch samples/s | paratrain samples/s | speed paratrain/torch (range) "
    "| torch peak MiB | paratrain peak MiB | memory paratrain/torch (range) "
    "| first loss paratrain / torch |\n|---|---|---|---|---|---|---|---|"
)


def format_llama_row(row: dict) -> str:
    speed, memory = row["samples_per_s"], row["peak_bytes"]
    mib = {key: f"{value / 2**20:.1f}" for key, value in memory.items()}
    loss = row["first_loss"]
    return (
        f"| {row['tensor']} | {speed['torch']:.1f} | {speed['paratrain']:.1f} "
        f"| {row['speed_ratio']:.3f} ({row['speed_range'][0]:.3f}-{row['speed_range'][1]:.3f}) "
        f"| {mib['torch']} | {mib['paratrain']} "
        f"| {row['memory_ratio']:.3f} "
        f"({row['memory_range'][0]:.3f}-{row['memory_range'][1]:.3f}) "
        f"| {loss['paratrain']:.6f} / {loss['torch']:.6f} |"
    )
