"""Engines take torch's fused CPU optimizer kernel only where the user left the choice."""

from __future__ import annotations

import pytest
import torch

from paratrain.parallel.fused_optim import with_fused_kernel


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize(
    "build",
    [
        lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
        lambda p: torch.optim.Adam([{"params": p[:1]}, {"params": p[1:], "lr": 5e-4}], lr=1e-3),
    ],
)
def test_left_to_torch_becomes_fused_with_the_same_hyperparameters_and_steps(build):
    looped_params, fused_params = params(), params()
    looped, fused = build(looped_params), with_fused_kernel(build(fused_params))
    assert fused.defaults["fused"] is True
    assert all(group["fused"] is True for group in fused.param_groups)
    skip = ("params", "fused")
    for mine, theirs in zip(fused.param_groups, looped.param_groups, strict=True):
        assert {k: v for k, v in mine.items() if k not in skip} == {
            k: v for k, v in theirs.items() if k not in skip
        }
        assert [id(p) for p in mine["params"]] != [id(p) for p in theirs["params"]]
    assert fused.param_groups[0]["params"][0] is fused_params[0]
    for _ in range(3):
        for optimizer, group in ((looped, looped_params), (fused, fused_params)):
            for param in group:
                param.grad = torch.full_like(param, 0.5) + param.detach()
            optimizer.step()
    for a, b in zip(looped_params, fused_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "build",
    [
        lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),  # the user chose
        lambda p: torch.optim.Adam(p, lr=1e-3, fused=False),
        lambda p: torch.optim.RMSprop(p, lr=1e-3),  # no fused CPU kernel
        lambda p: type("MyAdam", (torch.optim.Adam,), {})(p, lr=1e-3),  # may override step
    ],
)
def test_a_named_implementation_or_another_class_is_kept_as_built(build):
    optimizer = build(params())
    assert with_fused_kernel(optimizer) is optimizer


def test_an_optimizer_that_already_stepped_is_kept():
    group = params()
    optimizer = torch.optim.Adam(group, lr=1e-3)
    for param in group:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert with_fused_kernel(optimizer) is optimizer


def optimizer_kernels(strategy: str, options: dict) -> list:
    """In a worker: which kernel each of the engine's optimizers was built with."""
    import paratrain
    from paratrain.models import build_model, loss_for

    torch.manual_seed(0)
    engine = paratrain.setup(
        build_model("mlp", in_features=8, hidden=16, depth=2, classes=4),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        loss_fn=loss_for("mlp"),
        strategy=strategy,
        **options,
    )
    return [engine.optimizer.defaults.get("fused")]


@pytest.mark.parametrize(
    ("strategy", "options"), [("dp", {}), ("pipeline", {"stages": 2, "micro_batches": 2})]
)
def test_dp_and_pipeline_engines_build_the_fused_kernel(strategy, options):
    import paratrain

    results = paratrain.launch(optimizer_kernels, devices=2, args=(strategy, options))
    assert results == [[True], [True]]
