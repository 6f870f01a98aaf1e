"""Log-cosh's own promises, beyond the table's matrices: no overflow at large differences
in any dtype, small differences keeping their digits, and the gradient tanh(d)."""

from __future__ import annotations

import math

import pytest
import torch

import fusedloss

from conftest import TOLERANCE


def _exact(d: float) -> float:
    """log(cosh(d)) in float64, written so that it cannot overflow."""
    z = abs(d)
    return z + math.log1p(math.exp(-2 * z)) - math.log(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_large_differences_do_not_overflow(device, dtype):
    values = [1e4, -1e4, 3e4, 88.0, -90.0]
    input = torch.tensor(values, device=device).to(dtype).requires_grad_()
    target = torch.zeros(len(values), device=device, dtype=dtype)
    out = fusedloss.log_cosh_loss(input, target, reduction="none")
    grad = torch.autograd.grad(out.sum(), input)[0]
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    expected = torch.tensor([_exact(v) for v in input.detach().double().tolist()], dtype=torch.float64)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double().cpu(), input.detach().double().cpu().tanh(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_small_differences_keep_their_digits(device, reduction):
    """About d^2 / 2 near 0: written without the cancellation of |d| + softplus(-2|d|) - log 2,
    so float32 keeps float32's relative precision down to tiny d."""
    d = torch.logspace(-6, 0, 257, device=device)
    out = fusedloss.log_cosh_loss(d, torch.zeros_like(d), reduction="none")
    # cosh(d) - 1 = 2 sinh(d / 2)^2, without the cancellation of float64's cosh(d) - 1
    expected = torch.tensor([math.log1p(2 * math.sinh(v / 2) ** 2) for v in d.double().tolist()], dtype=torch.float64)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=4e-7, atol=0)
    total = fusedloss.log_cosh_loss(d, torch.zeros_like(d), reduction=reduction)
    torch.testing.assert_close(total.double().cpu(), expected.mean() if reduction == "mean" else expected.sum(),
                               rtol=2e-6, atol=0)


def test_gradient_is_tanh_with_grad_output(device):
    input = (torch.randn(1 << 12, device=device) * 4).requires_grad_()
    target = torch.randn(1 << 12, device=device)
    out = fusedloss.log_cosh_loss(input, target, reduction="sum")
    grad = torch.autograd.grad(out * 0.37, input)[0]
    expected = (input.detach().double() - target.double()).tanh() * 0.37
    torch.testing.assert_close(grad.double(), expected, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradient_where_the_branches_meet(device, dtype):
    """|d| = 1 exactly, where the formula's two branches meet (common in 16-bit data): the
    gradient is tanh(1) on every route, torch.func's too, not the 0 that a clamp's gradient
    at its bound gives on some torch releases."""
    input = torch.tensor([1.0, -1.0, 2.0, 0.0, 0.5], device=device, dtype=dtype, requires_grad=True)
    target = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5], device=device, dtype=dtype)
    expected = (input.detach().double() - target.double()).tanh().cpu()
    rtol, atol = TOLERANCE[dtype]
    grad = torch.autograd.grad(fusedloss.log_cosh_loss(input, target, reduction="sum"), input)[0]
    torch.testing.assert_close(grad.double().cpu(), expected, rtol=rtol, atol=atol)
    grad = torch.func.grad(lambda x: fusedloss.log_cosh_loss(x, target, reduction="sum"))(input.detach())
    torch.testing.assert_close(grad.double().cpu(), expected, rtol=rtol, atol=atol)


def _monotonic_bits(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bits as integers that count ulps: adjacent values differ by 1."""
    bits = x.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_difference_within_an_ulp(device, dtype):
    """Every finite 16-bit d, the loss and its gradient (grad_output 0.37) within 1 ulp of
    float64's, rounded to the dtype: where every result is 16-bit the kernels take the
    hardware's approximate exp2 and reciprocal and shorter fits, whose error must stay
    below the rounding."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    d = bits[torch.isfinite(bits)]
    input = d.to(device).requires_grad_()
    out = fusedloss.log_cosh_loss(input, torch.zeros_like(input), reduction="none")
    grad_output = torch.full_like(out, 0.37)
    grad = torch.autograd.grad(out, input, grad_output)[0]
    z = d.double().abs()
    # log1p(2 sinh(z / 2)^2) keeps small z's digits; beyond 1, z - log 2 has no cancellation
    near = torch.log1p(2 * torch.sinh(z.clamp(max=1) / 2) ** 2)
    expected = torch.where(z < 1, near, z + torch.log1p(torch.exp(-2 * z)) - math.log(2))
    expected_grad = d.double().tanh() * grad_output.double().cpu()
    for what, actual, exact in (("loss", out, expected), ("gradient", grad, expected_grad)):
        ulps = (_monotonic_bits(actual.detach().cpu()) - _monotonic_bits(exact.to(dtype))).abs()
        assert ulps.max().item() <= 1, f"{what}: {(ulps > 1).sum().item()} elements beyond 1 ulp"
