"""Engines take torch's fused CPU optimizer kernel only where the user left the choice."""

from __future__ import annotations

import pytest
import torch

import paratrain
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
    # Fused and looped kernels compute the same update in another op order (and FMA use,
    # which depends on the instruction set): the update differs by a few units of 2^-24,
    # and p - lr * update then rounds to the same fp32 value or one ulp (2^-23 = 1.2e-7
    # relative) away. Three steps: 3 ulps = 3.6e-7 relative, under rtol 1e-6; atol 1e-7
    # covers entries near zero, where the update's own few ulps (lr 0.1 x O(1) x 6e-8 per
    # step) are what remains.
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
    ("strategy", "options"),
    [
        ("dp", {}),
        ("pipeline", {"stages": 2, "micro_batches": 2}),
        ("zero1", {}),
        ("zero2", {}),
        ("zero3", {}),
    ],
)
def test_dp_pipeline_and_zero_engines_build_the_fused_kernel(strategy, options):
    import paratrain

    results = paratrain.launch(optimizer_kernels, devices=2, args=(strategy, options))
    assert results == [[True], [True]]


# ---- where the fused kernel would fail or differ, the default runs ---------------------
#
# Tolerance: the fused kernel and the default compute the same update in a different
# order of fp32 operations, so after a few steps they agree to a few ulps of each tensor
# (measured: at most 1.1e-7 of its norm here); 1e-6 relative per tensor holds them to
# that and is 100 times below the smallest difference a wrong update showed (1e-4: fp16
# rounding; 1e-2: a gradient strided unlike its parameter; a crash for SGD's late first
# gradient).

OPTIMIZERS = {
    "sgd-momentum": lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw),
    "sgd-nesterov-wd": lambda p, **kw: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.1, **kw
    ),
    "sgd-dampened": lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, **kw),
    "adam": lambda p, **kw: torch.optim.Adam(p, lr=0.01, **kw),
    "adam-amsgrad-wd": lambda p, **kw: torch.optim.Adam(
        p, lr=0.01, amsgrad=True, weight_decay=0.1, **kw
    ),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, **kw),
    "adagrad": lambda p, **kw: torch.optim.Adagrad(p, lr=0.1, **kw),
}
PATTERNS = {
    "second-gradient-from-step-3": lambda step, index: index != 1 or step >= 3,
    "second-skips-every-third-step": lambda step, index: index != 1 or step % 3 != 1,
    "only-the-late-one-at-its-first-step": lambda step, index: (
        (index == 1) == (step == 3) or (index != 1 and step > 3)
    ),
}


def three_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(5, 3), (4,), (2, 2)]
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def run_steps(build, has_grad, steps: int = 8, grad=None) -> list[torch.Tensor]:
    """Steps of ``build(params)``; each gives parameter i a gradient where ``has_grad(step,
    i)`` (else None, as the plain loop leaves an unused one)."""
    params = three_params()
    optimizer = build(params)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        optimizer.zero_grad()
        for index, param in enumerate(params):
            value = torch.randn(param.shape, generator=generator)
            if has_grad(step, index):
                param.grad = value if grad is None else grad(value)
        optimizer.step()
    return [p.detach().clone() for p in params]


def assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Per tensor, ||a - b|| / ||b|| <= 1e-6 (the suite's ``relative_error``).

    Derivation: the two kernels compute the same update in another op order; each step the
    new parameter rounds to the same fp32 value or one ulp (2^-23) away, and the gradients
    here do not depend on the parameters, so nothing compounds: ``run_steps``'s 8 steps give
    at most 8 x 2^-23 = 9.5e-7 relative."""
    for a, b in zip(actual, expected, strict=True):
        error = ((a - b).norm() / b.norm()).item()
        assert error <= 1e-6, error


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_without_gradients_at_some_steps_step_as_the_default(name, pattern):
    """Was: ``TypeError: expected Tensor as element 1 in argument 2, but got NoneType``
    from fused SGD with momentum, at the late parameter's first gradient."""
    build = OPTIMIZERS[name]
    expected = run_steps(build, PATTERNS[pattern])
    assert_same(run_steps(lambda p: with_fused_kernel(build(p)), PATTERNS[pattern]), expected)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam", "adamw"])
def test_a_gradient_strided_unlike_its_parameter_steps_as_the_default(name):
    """A contiguous gradient of a transposed (or channels-last) parameter: the fused
    kernel pairs elements by memory order (was 1-10% off, silently)."""
    build = OPTIMIZERS[name]

    def transposed(value: torch.Tensor) -> torch.Tensor:
        return value.t().contiguous().t() if value.dim() == 2 else value

    expected = run_steps(build, lambda s, i: True, grad=transposed)
    assert_same(
        run_steps(lambda p: with_fused_kernel(build(p)), lambda s, i: True, grad=transposed),
        expected,
    )


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adagrad])
def test_sparse_gradients_step_as_the_default(kind):
    """An ``nn.Embedding(sparse=True)`` with SGD or Adagrad (was: the fused kernel's
    RuntimeError, 'does not support sparse gradients')."""

    def train(wrap) -> torch.Tensor:
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        optimizer = wrap(kind(embedding.parameters(), lr=0.1))
        for step in range(3):
            optimizer.zero_grad()
            embedding(torch.tensor([step, step + 2])).square().sum().backward()
            optimizer.step()
        return embedding.weight.detach().clone()

    assert_same([train(with_fused_kernel)], [train(lambda o: o)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.complex64])
def test_parameters_of_other_dtypes_keep_the_default(dtype):
    """fp16/bf16: the fused kernel rounds differently (1e-4 to 4e-3 apart after three
    steps); complex: it refuses them."""
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.randn(3).to(dtype))], lr=1e-3)
    assert with_fused_kernel(optimizer) is optimizer


def test_what_the_fused_kernel_itself_does_on_this_torch():
    """The measurements behind ``fused_optim``'s rules, on torch's own optimizers: if one
    of these changes with a new torch, the rules (and their docstring) can change too."""
    late = PATTERNS["second-gradient-from-step-3"]
    for name in ("sgd-momentum", "sgd-dampened"):
        with pytest.raises(TypeError, match="expected Tensor"):
            run_steps(lambda p, n=name: OPTIMIZERS[n](p, fused=True), late)
    for name in ("adam", "adam-amsgrad-wd", "adamw", "adagrad"):
        assert_same(
            run_steps(lambda p, n=name: OPTIMIZERS[n](p, fused=True), late),
            run_steps(OPTIMIZERS[name], late),
        )
    grad = lambda value: value.t().contiguous().t() if value.dim() == 2 else value  # noqa: E731
    fused = run_steps(lambda p: OPTIMIZERS["adam"](p, fused=True), lambda s, i: True, grad=grad)
    default = run_steps(OPTIMIZERS["adam"], lambda s, i: True, grad=grad)
    # Misread strides apply other entries' gradients: Adam's early steps move each entry by
    # about lr = 1e-2 in the gradient's sign, so wrong entries differ by O(1e-2), where
    # rounding differs by 8 ulps (~1e-6): 1e-3 lies between.
    assert (fused[0] - default[0]).abs().max() > 1e-3


def test_the_fallback_is_per_step_and_leaves_the_group_fused():
    params = three_params()
    optimizer = with_fused_kernel(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["fused"]))
    for step in range(4):
        for index, param in enumerate(params):
            param.grad = torch.ones_like(param) if index != 1 or step >= 2 else None
        optimizer.step()
    assert seen == [True, True, False, True]  # step 2: param 1's first buffer beside others
    assert optimizer.param_groups[0]["fused"] is True


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_dp_with_a_parameter_whose_first_gradient_comes_late(devices):
    """dp builds the fused kernel; ``second`` first gets a gradient at step 3. At 1 worker
    this crashed (fused SGD's TypeError); at 2 it also trained ``second`` on zeros."""
    from tests import workers
    from tests.test_parity_dp import TOLERANCE, relative_error

    cases = [("late", "sgd", 1), ("late", "adam", 1)]
    results = paratrain.launch(workers.dp_parity_worker, devices=devices, args=(cases, {}))
    for case, (state, losses) in zip(cases, results[0], strict=True):
        reference, reference_losses = workers.train_with("single", *case)
        assert relative_error(state, reference) <= TOLERANCE, case
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
