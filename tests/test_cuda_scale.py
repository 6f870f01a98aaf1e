"""Memory over many steps, and inputs past 2^31 elements or as large as the GPU holds."""

from __future__ import annotations

import gc

import pytest
import torch

import fusedloss
from fusedloss import build, formulas

from conftest import LOSSES, PARAMS, loss_kwargs, requires_cuda

pytestmark = requires_cuda
GIB = 1 << 30


@pytest.fixture(autouse=True)
def kernels(gpu_to_itself):
    build.load()
    yield
    torch.cuda.empty_cache()


def _needs_memory(nbytes: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GIB:.0f} GiB of free GPU memory, {free / GIB:.0f} GiB free")


def _loss(name, input, target, reduction="mean"):
    return LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]))


def _chunked_float64(name, input, target, reduction, chunk=1 << 26):
    """The loss's reference formula in float64 over `chunk` elements at a time; the sum stays on the GPU."""
    total = torch.zeros((), dtype=torch.float64, device=input.device)
    for start in range(0, input.numel(), chunk):
        total += formulas.torch_loss(input[start : start + chunk].double(), target[start : start + chunk].double(),
                                     name, PARAMS[name], "sum")
    return total / input.numel() if reduction == "mean" else total


def test_ten_thousand_training_steps_leave_memory_flat():
    input = torch.randn(1000, 37, device="cuda") * 3
    target = torch.randn(37, device="cuda")
    steps = [(name, reduction, scale) for name in LOSSES for reduction in ("none", "mean", "sum")
             for scale in (1.0, 0.5)]

    def run(count):
        for index in range(count):
            name, reduction, scale = steps[index % len(steps)]
            leaf, leaf_target = input.detach().requires_grad_(), target.detach().requires_grad_()
            out = _loss(name, leaf, leaf_target, reduction)
            out.backward(torch.full_like(out, scale))

    run(len(steps) * 4)
    gc.collect()  # cycles left by earlier tests would be freed mid-run
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run(10_000)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def test_more_than_2_31_elements_with_gradients():
    n = (1 << 31) + 9  # odd, and past int32 indexing
    _needs_memory(3 * 4 * n + 8 * GIB)
    storage = torch.randn(n + 1, device="cuda") * 3
    input = storage[1:].requires_grad_()  # a misaligned view
    target = torch.randn(n, device="cuda")
    for name in LOSSES:
        input.grad = None
        out = _loss(name, input, target)
        out.backward()
        expected = _chunked_float64(name, input.detach(), target, "mean")
        torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=0)
        for start in (0, (1 << 31) - 5, n - 1000):  # including the elements past 2^31
            grad = formulas.loss_grad(input[start : start + 1000].detach().double(),
                                      target[start : start + 1000].double(), name, PARAMS[name]) / n
            torch.testing.assert_close(input.grad[start : start + 1000].double(), grad, rtol=2e-6, atol=1e-30)
    input.grad = None
    with torch.no_grad():
        pointwise = _loss("huber", input, target, reduction="none")
        tail = slice(n - 4097, n)
        torch.testing.assert_close(pointwise[tail].double(), formulas.torch_loss(
            input[tail].double(), target[tail].double(), "huber", PARAMS["huber"], "none"), rtol=2e-6, atol=1e-30)
        torch.testing.assert_close(_loss("mse", input, target, "sum").double(),
                                   _chunked_float64("mse", input, target, "sum"), rtol=2e-6, atol=0)


@pytest.mark.parametrize("weight_shape", [(1, 32769, 1), (1, 1, 65537)], ids=["per-row", "per-column"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_weighted_past_2_32_elements_with_gradients(weight_shape, reduction):
    """A weight read where it lies over more than 2^32 elements (64-bit weight indices), with
    a scale on the device and the gradient written by the forward."""
    shape = (2, 32769, 65537)  # 2^32 + 262210 elements
    n = shape[0] * shape[1] * shape[2]
    _needs_memory(3 * 2 * n + 12 * GIB)
    input = torch.randn(shape, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_()
    target = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(weight_shape, device="cuda") + 0.25
    scale = torch.tensor(2.0**-30, device="cuda")
    out = fusedloss.mse_loss(input, target, weight=weight, reduction=reduction, scale=scale)
    out.backward()
    assert out.dtype == torch.float32
    expected = torch.zeros((), dtype=torch.float64, device="cuda")
    rows = 1024
    with torch.no_grad():
        for sample in range(shape[0]):
            for row in range(0, shape[1], rows):
                part = (slice(sample, sample + 1), slice(row, row + rows))
                squared = (input[part].double() - target[part].double()) ** 2
                expected += (squared * weight.expand(shape)[part].double()).sum()
    factor = scale.double()
    if reduction == "mean":
        factor = factor / (weight.double().sum() * (n // weight.numel()))
    torch.testing.assert_close(out.double(), expected * factor, rtol=2e-6, atol=0)
    flat_input, flat_target, flat_grad = input.detach().view(-1), target.view(-1), input.grad.view(-1)
    for start in (0, (1 << 31) - 5, (1 << 32) - 5, n - 1000):  # past 2^31 and 2^32 too
        part = slice(start, start + 1000)
        element_weight = weight.expand(shape)[torch.unravel_index(torch.arange(start, start + 1000, device="cuda"),
                                                                  shape)]
        grad = 2 * (flat_input[part].double() - flat_target[part].double()) * element_weight.double() * factor
        # one bfloat16 rounding of the float32 gradient
        torch.testing.assert_close(flat_grad[part].double(), grad.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-30)


def test_the_largest_float16_pair_that_fits():
    free, _ = torch.cuda.mem_get_info()
    n = (free - 8 * GIB) // 4 - 3  # two fp16 operands; 8 GiB left for the float64 reference's chunks
    if n < 1 << 31:
        pytest.skip(f"only {free / GIB:.0f} GiB of free GPU memory")
    input = torch.randn(n, dtype=torch.float16, device="cuda")
    target = torch.randn(n, dtype=torch.float16, device="cuda")
    input *= 3
    with torch.no_grad():
        for name in LOSSES:
            out = _loss(name, input, target)
            assert out.dtype == torch.float16
            expected = _chunked_float64(name, input, target, "mean")
            # one fp16 rounding of the result: 2^-11 relative
            torch.testing.assert_close(out.double(), expected, rtol=2**-11, atol=0)
    print(f"largest float16 pair: 2 x {n} elements ({4 * n / GIB:.1f} GiB)")
