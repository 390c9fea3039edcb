"""Worker functions for the ZeRO tests (spawned workers import them by name)."""

from __future__ import annotations

import torch

from tests.workers import (
    parity_batches,
    parity_engine,
    parity_model,
    parity_optimizer,
    train_with,
)

STAGES = ("zero1", "zero2", "zero3")


def zero_parity_worker(
    strategies: list[str], cases: list[tuple], options: dict
) -> dict[str, list[tuple[dict, list[float]]]]:
    """Every parity case under every ZeRO stage in one launch (starting workers is slow)."""
    return {
        strategy: [
            train_with(strategy, *case, **(options if strategy != "zero3" else {}))
            for case in cases
        ]
        for strategy in strategies
    }


def gpt_state_bytes_worker(model_options: dict) -> dict[str, dict[str, int]]:
    """Per-worker model-state bytes of each stage after one Adam step on a gpt."""
    import paratrain
    from paratrain.models import build_model, loss_for

    ledgers = {}
    for strategy in STAGES:
        torch.manual_seed(0)
        engine = paratrain.setup(
            build_model("gpt", **model_options),
            optimizer=parity_optimizer("adam"),
            loss_fn=loss_for("gpt"),
            strategy=strategy,
        )
        vocab, block = model_options["vocab_size"], model_options["block_size"]
        x = torch.randint(0, vocab, (8, block), generator=torch.Generator().manual_seed(0))
        engine.train_step(x, x)
        ledgers[strategy] = engine.model_state_bytes()
    return ledgers


def contract_worker(strategy: str) -> dict:
    """One launch checks the rest of the contract: eval, reload, uneven batch, comm bytes."""
    engine = parity_engine(strategy, "gpt", "adam")
    x, y = parity_batches("gpt")[0]
    comm_bytes = engine.train_step(x, y).comm_bytes
    loss = engine.eval_step(x, y)
    state = engine.state_dict()
    engine.load_state_dict({name: tensor + 1.0 for name, tensor in state.items()})
    try:
        engine.train_step(x[:5], y[:5])
        uneven = "no error"
    except ValueError as error:
        uneven = str(error)
    return {
        "eval": loss,
        "state": state,
        "reloaded": engine.state_dict(),
        "uneven": uneven,
        "comm_bytes": comm_bytes,
        "padded": sum(unit.padded_numel for unit in engine.units),
        "shards": sum(unit.shard_numel for unit in engine.units),
        "parameter_bytes": engine.parameter_bytes,
    }


def all_stages_contract_worker() -> dict[str, dict]:
    """``contract_worker`` for the three stages in one launch."""
    return {strategy: contract_worker(strategy) for strategy in STAGES}


def precision_worker(steps: int) -> dict[str, dict]:
    """dp and every stage under bf16 and fp16 (a scale that overflows at first)."""
    from paratrain.parallel.precision import Precision

    results = {}
    for strategy in ("dp", *STAGES):
        for name in ("bf16", "fp16"):
            precision = Precision("fp16", init_scale=2.0**21) if name == "fp16" else name
            engine = parity_engine(strategy, "gpt", "adam", precision=precision)
            stats = [engine.train_step(x, y) for x, y in parity_batches("gpt")[:steps]]
            results[f"{strategy}/{name}"] = {
                "state": engine.state_dict(),
                "losses": [s.loss for s in stats],
                "skipped": [s.skipped_steps for s in stats],
                "scales": [s.loss_scale for s in stats],
                "activation_peak": engine.memory.activation_peak_bytes(),
            }
    return results


RECOMPUTE_STEPS = 4


def recompute_worker(cases: list[tuple[str, str, int, bool]]) -> dict[str, dict]:
    """Each (strategy, model, accumulation, early_stop) with recompute off and on.

    Adam on the parity batches, every engine built from the same seed. ``early_stop`` is
    torch.utils.checkpoint's: when off, a segment's recompute runs to its end, so the
    unit's post-forward hook fires in the middle of backward."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    results = {}
    for strategy, kind, accumulation, early_stop in cases:
        for recompute in (False, True):
            engine = parity_engine(strategy, kind, "adam", accumulation, recompute=recompute)
            batches = parity_batches(kind)[:RECOMPUTE_STEPS]
            with set_checkpoint_early_stop(early_stop):
                stats = [engine.train_step(x, y) for x, y in batches]
            results[f"{strategy}/{kind}/k{accumulation}/{early_stop}/{recompute}"] = {
                "state": engine.state_dict(),
                "losses": [s.loss for s in stats],
                "comm_bytes": [s.comm_bytes for s in stats],
                "activation_peak": engine.memory.activation_peak_bytes(),
                "gathered_after": [unit.gathered for unit in engine.units],
            }
    return results


def optimizer_refusals_worker() -> dict[str, str]:
    """The messages ``paratrain.setup`` raises for optimizers flat slices would break."""
    import paratrain
    from paratrain.models import loss_for

    def lbfgs(params):
        return torch.optim.LBFGS(params, lr=0.1)

    def two_groups(params):
        first, *rest = list(params)
        return torch.optim.Adam([{"params": [first]}, {"params": rest, "lr": 0.1}], lr=0.01)

    def vouched(params):
        return torch.optim.LBFGS(params, lr=0.1)

    messages = {}
    for strategy in STAGES:
        for label, factory, options in (
            ("lbfgs", lbfgs, {}),
            ("groups", two_groups, {}),
            ("vouched", vouched, {"elementwise_optimizer": True}),
        ):
            try:
                paratrain.setup(
                    parity_model("gpt"),
                    optimizer=factory,
                    loss_fn=loss_for("gpt"),
                    strategy=strategy,
                    **options,
                )
                messages[f"{strategy}/{label}"] = "accepted"
            except ValueError as error:
                messages[f"{strategy}/{label}"] = str(error)
    return messages
