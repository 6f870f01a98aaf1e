"""The optional C++ autograd (csrc/cxx_autograd.cpp): compiled with the host compiler for
this torch, it gives the same values and gradients, bit for bit, as ops.py's autograd,
on every device the operators serve, and fusedloss's functions take it for small steps."""

from __future__ import annotations

import pytest
import torch

import fusedloss
from fusedloss import build, losses, ops

from conftest import PARAMS, heavy_tailed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


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


def _weighted_steps(device, dtype):
    """Weighted steps whose forward writes no gradient: a weight (of the loss's size, per
    row, a mask), a scale (a number, a tensor), a param per element (quantiles, pseudo-Huber's c)."""
    weight = torch.rand(37, 5, device=device, dtype=dtype) + 0.5
    scale = torch.tensor(0.5, device=device, dtype=dtype)
    quantiles = [0.1, 0.3, 0.5, 0.7, 0.9]
    c = torch.rand(37, 1, device=device, dtype=dtype) + 0.1
    return {
        "weight": lambda i, t: fusedloss.mse_loss(i, t, weight=weight),
        "weight per row, sum": lambda i, t: fusedloss.huber_loss(i, t, reduction="sum", weight=weight[:, :1]),
        "mask": lambda i, t: fusedloss.l1_loss(i, t, weight=weight > 0.9),
        "number scale": lambda i, t: fusedloss.log_cosh_loss(i, t, scale=0.25),
        "tensor scale": lambda i, t: fusedloss.smooth_l1_loss(i, t, scale=scale),
        "quantiles": lambda i, t: fusedloss.quantile_loss(i, t[:, :1], quantiles),
        "c per row": lambda i, t: fusedloss.pseudo_huber_loss(i, t, c),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wanted", [(True, True), (True, False), (False, True)])
def test_weighted_steps_same_bits_on_both_autograds(cxx_autograd, device, request, monkeypatch, dtype, wanted):
    """The weighted operator's steps through the C++ autograd's node and through ops.py's
    autograd: the same values and gradients, bit for bit, for grad_output 1 and 0.37, and a
    double backward that differentiates the same formulas."""
    if request.node.callspec.params["device"] == "cpu":
        pytest.skip("the CPU route runs torch operations; fused-cpu takes the operators")
    input, target = _operands(device, dtype, (37, 5), wanted)
    leaves = [t for t in (input, target) if t.requires_grad]
    for name, step in _weighted_steps(device, dtype).items():
        results = []
        for loaded in (True, False):
            monkeypatch.setattr(build, "cxx_autograd_loaded", lambda loaded=loaded: loaded)
            out = step(input, target)
            grads = [g for go in (1.0, 0.37) for g in torch.autograd.grad(
                out, leaves, torch.tensor(go, device=device, dtype=out.dtype), retain_graph=True)]
            twice = torch.autograd.grad(out, leaves, create_graph=True)
            second = [None] * len(leaves)
            if any(g.requires_grad for g in twice):  # the quantile loss's second derivative is 0
                second = torch.autograd.grad(sum(g.square().sum() for g in twice if g.requires_grad), leaves,
                                             allow_unused=True)
            results.append((out.grad_fn.name(), out.detach(), grads, second))
        (cxx_node, cxx_out, cxx_grads, cxx_second), (python_node, python_out, python_grads, python_second) = results
        # where the Python route is the operator's autograd (the others: torch operations on some devices)
        assert (cxx_node == "WeightedLossBackward") == (python_node == "weighted_lossBackward"), name
        if name in ("number scale", "quantiles", "c per row") or device == "cuda":
            assert cxx_node == "WeightedLossBackward", name
        torch.testing.assert_close(cxx_out, python_out, rtol=0, atol=0, equal_nan=True, msg=name)
        for got, want in zip(cxx_grads, python_grads):
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
        for got, want in zip(cxx_second, python_second):
            assert (got is None) == (want is None), name
            if got is not None:
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
