"""The optional C++ autograd (csrc/cxx_autograd.cpp): compiled with the host compiler for
this torch, it gives the same values and gradients, bit for bit, as ops.py's autograd,
on every device the operators serve, and fusedloss's functions take it for small steps."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import fusedloss
from fusedloss import build, losses, ops

from conftest import PARAMS, heavy_tailed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@pytest.fixture(scope="module")
def cxx_autograd(tmp_path_factory):
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no host C++ compiler")
    if not build.cxx_autograd_loaded():
        previous = os.environ.get("TORCH_EXTENSIONS_DIR")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("extensions"))
        try:
            assert build.load_cxx_autograd(build_if_missing=True), "the C++ autograd did not compile"
        finally:
            if previous is None:
                del os.environ["TORCH_EXTENSIONS_DIR"]
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = previous
    return torch.ops.fusedloss_cxx


@pytest.fixture(autouse=True)
def kernels_loaded():
    """The tests call the operators directly: on CUDA, their kernels must be loaded first."""
    if torch.cuda.is_available():
        build.load()


def _operands(device, dtype, target_shape, wanted):
    input = heavy_tailed((37, 5), dtype, device).requires_grad_(wanted[0])
    target = heavy_tailed(target_shape, dtype, device).requires_grad_(wanted[1])
    return input, target


def _run(route, input, target, loss, param, reduction, grad):
    out = route(input, target, loss, param, reduction)
    leaves = [t for t in (input, target) if t.requires_grad]
    return out, torch.autograd.grad(out, leaves, grad)


def _python(input, target, loss, param, reduction):
    if reduction == "none":
        return ops.PointwiseLoss.apply(input, target, (loss, param, False))
    return ops.ReducedLoss.apply(input, target, (loss, param, reduction, [False, False], -1, 1.0, False))[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("reduction", ("none", "mean", "sum"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target_shape,wanted", [((37, 5), (True, True)), ((5,), (True, False)),
                                                 ((37, 1), (False, True))])
def test_same_bits_as_the_python_autograd(cxx_autograd, device, loss, reduction, dtype, target_shape, wanted):
    input, target = _operands(device, dtype, target_shape, wanted)
    param = PARAMS[loss]

    def cxx(input, target, loss, param, reduction):
        if reduction == "none":
            return cxx_autograd.pointwise_loss(input, target, loss, param, False)
        return cxx_autograd.reduced_loss(input, target, loss, param, reduction, False)

    grad = torch.randn((37, 5) if reduction == "none" else (), device=device, dtype=dtype) * 0.37
    expected, expected_grads = _run(_python, input, target, loss, param, reduction, grad)
    actual, actual_grads = _run(cxx, input, target, loss, param, reduction, grad)
    assert type(actual.grad_fn).__name__ != type(expected.grad_fn).__name__  # two routes indeed
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    for got, want in zip(actual_grads, expected_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ("none", "mean"))
def test_create_graph_differentiates_again(cxx_autograd, device, reduction):
    input = torch.randn(9, 4, device=device, dtype=torch.float64, requires_grad=True)
    target = torch.randn(4, device=device, dtype=torch.float64, requires_grad=True)
    if reduction == "none":
        out = cxx_autograd.pointwise_loss(input, target, "huber", 0.5, False).sum()
    else:
        out = cxx_autograd.reduced_loss(input, target, "huber", 0.5, reduction, False)
    reference = torch.nn.functional.huber_loss(input, target.expand(9, 4), reduction="mean", delta=0.5)
    if reduction == "none":
        reference = reference * input.numel()
    for route in (out, reference):
        grad_input, grad_target = torch.autograd.grad(route, (input, target), create_graph=True)
        route.second = torch.autograd.grad((grad_input.square().sum() + grad_target.sum()), (input, target))
    for got, want in zip(out.second, reference.second):
        torch.testing.assert_close(got, want)


def test_refuses_dual_operands(cxx_autograd):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        input = fwAD.make_dual(torch.randn(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="no forward-mode AD rule"):
            cxx_autograd.reduced_loss(input, torch.zeros(4, dtype=torch.float64), "mse", 0.0, "mean", False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("reduction", ("none", "mean"))
def test_the_functions_take_it_for_small_steps(cxx_autograd, reduction):
    build.load()
    input = torch.randn(1000, device="cuda", requires_grad=True)
    out = fusedloss.mse_loss(input, torch.randn(1000, device="cuda"), reduction=reduction)
    assert out.grad_fn.name() in ("ReducedLossBackward", "PointwiseLossBackward")
