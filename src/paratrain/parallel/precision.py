"""Mixed precision for every engine: autocast, and dynamic loss scaling for fp16.

``precision="bf16"`` or ``"fp16"`` runs forward (and so backward) under ``torch.autocast``
on the worker's device; weights, gradients and optimizer state stay fp32 (autocast casts
weights per operation), so the optimizer step is the fp32 one. PyTorch 2.13 autocasts
both dtypes on CPU as well as on CUDA.

bf16 has fp32's exponent range, so it needs nothing more. fp16 does not: small gradients
underflow to zero. The standard cure (Micikevicius et al., "Mixed Precision Training",
2018; ``torch.amp.GradScaler``) multiplies the loss by a large scale before backward and
divides the gradients by it before the step. A scale too large makes gradients overflow
to inf/NaN: that step is skipped (no optimizer update) and the scale halved; after
``growth_interval`` clean steps in a row it doubles again.

Why not ``GradScaler`` itself: workers must *agree* on skipping. Under data parallelism
the averaged gradients are already identical on every rank, so each rank's own check
agrees; but pipeline stages each hold different parameters, so an overflow on one stage
must skip the step on all of them. ``unscale_and_check`` does that with one all-reduce of
the overflow flag when asked, and counts skipped steps for the metrics.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.distributed import ProcessGroup

from paratrain.runtime import comm

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """The numeric format of one engine's compute, and its loss scale (fp16 only).

    ``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval`` are
    ``torch.amp.GradScaler``'s defaults; pass an instance as ``precision=`` to change them.
    """

    def __init__(
        self,
        name: str = "fp32",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {name!r}.")
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                "loss scaling needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor "
                f"< 1, not {init_scale}, {growth_factor} and {backoff_factor}."
            )
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, not {growth_interval}.")
        self.name = name
        self.dtype = _DTYPES.get(name)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.scale = float(init_scale) if name == "fp16" else 1.0
        self.skipped_steps = 0
        self._clean_steps = 0

    @classmethod
    def of(cls, precision: str | Precision) -> Precision:
        """An engine's own ``Precision``: from a name, or a copy of an instance.

        A copy, because an instance passed in is configuration: two engines built from it
        must not share (and both move) one loss scale.
        """
        return copy.deepcopy(precision) if isinstance(precision, Precision) else cls(precision)

    @property
    def scales_loss(self) -> bool:
        """Whether losses are scaled and gradients checked (fp16)."""
        return self.name == "fp16"

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """The context to run forward passes in (a no-op for fp32)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def loss_factor(self, factor: float = 1.0) -> float:
        """What to multiply a loss by before backward: the engine's own ``factor`` x scale."""
        return factor * self.scale

    def unscale_and_check(
        self,
        grads: Iterable[torch.Tensor | None],
        *,
        group: ProcessGroup | None = None,
        synchronized: bool = False,
        device: torch.device | None = None,
    ) -> bool:
        """Divide ``grads`` by the scale and decide whether to take the step (fp16).

        Returns True when every gradient is finite on every worker that shares the step.
        ``synchronized=True`` says the gradients are already identical on those workers
        (averaged by an all-reduce), so no message is needed; otherwise the overflow flag
        is summed over ``group`` (the whole job by default). Updates the scale and the
        skipped-step count. ``device`` holds the flag where this worker has no gradients
        (a parameter-free pipeline stage still takes part in the vote). For bf16 and fp32
        it does nothing and returns True.
        """
        if not self.scales_loss:
            return True
        grads = [g for g in grads if g is not None]
        device = grads[0].device if grads else (device or torch.device("cpu"))
        found = torch.zeros(1, device=device)
        if grads:
            # GradScaler's own fused kernel: one pass that unscales and flags inf/NaN.
            inverse = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        if not synchronized and comm.distributed():
            comm.all_reduce_sum(found, group=group)
        finite = bool(found.item() == 0)
        self._update(finite)
        return finite

    def _update(self, finite: bool) -> None:
        if not finite:
            self.skipped_steps += 1
            self.scale *= self.backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Scale, clean-step count and skipped steps (for checkpoints)."""
        return {
            "name": self.name,
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state of the same precision."""
        if state.get("name") != self.name:
            raise ValueError(
                f"the checkpoint was trained with precision {state.get('name')!r}; "
                f"resume it with precision={state.get('name')!r}, not {self.name!r}."
            )
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
