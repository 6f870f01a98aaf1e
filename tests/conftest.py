"""Shared helpers: fresh seeds, heavy-tailed inputs, float64 references, tolerances."""

from __future__ import annotations

import secrets

import pytest
import torch

import fusedloss
from fusedloss import formulas, routing

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_PAIRS = [(a, b) for a in FLOAT_DTYPES for b in FLOAT_DTYPES]

# (rtol, atol) against a float64 reference, by the dtype the loss is returned in.
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-6, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

# name -> (fusedloss function, torch.nn.functional function, parameter keyword)
LOSSES = {
    "mse": (fusedloss.mse_loss, torch.nn.functional.mse_loss, None),
    "l1": (fusedloss.l1_loss, torch.nn.functional.l1_loss, None),
    "smooth_l1": (fusedloss.smooth_l1_loss, torch.nn.functional.smooth_l1_loss, "beta"),
    "huber": (fusedloss.huber_loss, torch.nn.functional.huber_loss, "delta"),
}


@pytest.fixture
def fused_cpu(monkeypatch):
    """Route CPU tensors through the fused path: argument handling, then the fusedloss:: ops'
    CPU reference kernels, as CUDA tensors go through them to the CUDA kernels."""
    from fusedloss import build

    monkeypatch.setattr(build, "load", lambda *families: {})
    monkeypatch.setattr(
        routing,
        "kernels_apply",
        lambda input, target: input.device == target.device
        and input.dtype in routing.KERNEL_DTYPES
        and target.dtype in routing.KERNEL_DTYPES,
    )


@pytest.fixture(autouse=True)
def forgotten_grad_outputs():
    """Each test starts with no note of earlier backwards (fusedloss.grad_output_prediction):
    every forward that writes the gradient expects a grad_output of 1."""
    from fusedloss import grad_output_prediction

    if grad_output_prediction._history and torch.cuda.is_available():
        torch.cuda.synchronize()  # no kernel may still be writing a note
    for history in grad_output_prediction._history.values():
        history[:] = [1.0, 0.0] * (len(history) // 2)  # grad_output 1, not mispredicted


@pytest.fixture(autouse=True)
def fresh_seed():
    """A new seed every run; printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    torch.manual_seed(seed)
    print(f"torch seed = {seed}")
    return seed


def warm_up_for_capture(step, *args, steps: int = 3) -> None:
    """`step(*args)` a few times on a side stream, then joined to the current one: the
    warm-up CUDA graph capture asks for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)


def heavy_tailed(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Symmetric Pareto-like values: about 3/4 within (-1, 1), the rest out to ~1e3,
    so both branches of Smooth L1 and Huber are taken."""
    u = torch.rand(shape, dtype=torch.float64, device=device).clamp_min(1e-6)
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    return ((u.pow(-0.5) - 1) * sign).to(dtype)


def loss_kwargs(name: str, param: float) -> dict:
    keyword = LOSSES[name][2]
    return {} if keyword is None else {keyword: param}


def as_computed(name: str, input, target):
    """The target as PyTorch's kernels use it: on CUDA, Huber converts it to the input's
    dtype (its CPU kernel computes in the promoted dtype)."""
    return target.to(input.dtype) if name == "huber" and input.is_cuda else target


def as_seen_by_gradient(name: str, input, target, of_input: bool):
    """(input, target) as PyTorch's CUDA kernels see them when they compute the gradient
    of the input (`of_input`) or of the target. Smooth L1's backward converts the other
    operand to that gradient's dtype. The others are differentiated as computed: Huber in
    the input's dtype, MSE and L1 in the promoted one (PyTorch's MSE and Huber backward
    reject mixed dtypes; L1's gradient is composed by autograd). The CPU kernels use the
    promoted dtype."""
    if not input.is_cuda or name in ("mse", "l1"):
        return input, target
    if name == "huber" or of_input:
        return input, target.to(input.dtype)
    return input.to(target.dtype), target


def float64_reference(name: str, input, target, reduction: str, param: float = 1.0) -> torch.Tensor:
    """PyTorch's own formula evaluated in float64."""
    loss_id = "l1" if name == "smooth_l1" and param == 0 else name
    target = as_computed(name, input, target)
    return formulas.torch_loss(input.double(), target.double(), loss_id, param, reduction)


def assert_close_to_reference(actual, expected64, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64.cpu(), rtol=rtol, atol=atol, equal_nan=True)


def pytest_terminal_summary(terminalreporter):
    """Skips as a few lines, one per reason with its count, instead of one per test location."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.line(f"{count:6d}  {reason}")
