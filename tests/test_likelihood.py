"""gaussian_nll_loss and poisson_nll_loss: PyTorch's values, dtypes, errors and gradients
(PyTorch's OpInfo and ModuleInfo samples too), the Gaussian loss's check of var without
a host sync, and weight=, scale= and dim= around both."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCE, heavy_tailed, requires_cuda

import fusedloss
from fusedloss import likelihood

SHAPE = (4, 5, 6)
VAR_SHAPES = {"same": SHAPE, "homoscedastic": SHAPE[:-1], "one-column": (4, 5, 1), "one-middle": (4, 1, 6)}


def _no_sync(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """The route a GPU's var takes (checked without a host sync), called on any device."""
    per_element = likelihood.gaussian_nll_elementwise(input, target, var, full, eps, reduction)
    return {"none": per_element, "mean": per_element.mean(), "sum": per_element.sum()}[reduction]


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as error:  # the type and message are what is compared
        return type(error), str(error)
    return None


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float64,) * 3,
                                    (torch.float32, torch.float64, torch.float32)], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("var_shape", VAR_SHAPES)
def test_gaussian_matches_torch_on_both_routes(var_shape, full, reduction, dtypes):
    """Bit for bit: the same operations as PyTorch's, in its order; var's gradient passes
    the clamp at eps (some entries lie below it)."""
    input = heavy_tailed(SHAPE, dtypes[0]).requires_grad_()
    target = heavy_tailed(SHAPE, dtypes[1]).requires_grad_()
    var = torch.rand(VAR_SHAPES[var_shape], dtype=dtypes[2]) * 2
    var.view(-1)[:3] = torch.tensor([0.0, 1e-9, 1e-6])
    var.requires_grad_()
    expected = F.gaussian_nll_loss(input, target, var, full=full, reduction=reduction)
    for fn in (fusedloss.gaussian_nll_loss, _no_sync):
        out = fn(input, target, var, full=full, reduction=reduction)
        assert out.dtype == expected.dtype and torch.equal(out, expected)
        grad_output = torch.rand_like(out) + 0.5
        got = torch.autograd.grad(out, (input, target, var), grad_output)
        want = torch.autograd.grad(expected, (input, target, var), grad_output, retain_graph=True)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_gaussian_float_var_and_its_errors():
    x, y = heavy_tailed(SHAPE), heavy_tailed(SHAPE)
    torch.testing.assert_close(fusedloss.gaussian_nll_loss(x, y, 0.5), F.gaussian_nll_loss(x, y, 0.5), rtol=0, atol=0)
    for args, kwargs in [((x, y, -0.5), {}), ((x, y, torch.rand(4, 6)), {}), ((x, y, torch.rand(4, 5, 2)), {}),
                         ((x, y, torch.rand(SHAPE)), {"reduction": "bogus"})]:
        expected = _error_of(F.gaussian_nll_loss, *args, **kwargs)
        assert expected is not None
        assert _error_of(fusedloss.gaussian_nll_loss, *args, **kwargs) == expected
        if isinstance(args[2], torch.Tensor):
            assert _error_of(_no_sync, *args, **kwargs) == expected


def test_gaussian_negative_var_is_nan_without_a_sync_and_pytorchs_error_on_the_cpu():
    x, y = heavy_tailed(SHAPE).requires_grad_(), heavy_tailed(SHAPE)
    var = (torch.rand(SHAPE) + 0.1).requires_grad_()
    negative = var.detach().clone()
    negative[1, 2, 3] = -0.25
    negative.requires_grad_()
    assert _error_of(fusedloss.gaussian_nll_loss, x, y, negative) == (ValueError, "var has negative entry/entries")
    per_element = _no_sync(x, y, negative, reduction="none")
    assert per_element[1, 2, 3].isnan() and per_element.isnan().sum() == 1
    assert _no_sync(x, y, negative).isnan() and _no_sync(x, y, negative, reduction="sum").isnan()
    grad_x, grad_var = torch.autograd.grad(per_element.sum(), (x, negative))
    assert grad_x[1, 2, 3].isnan() and grad_x.isnan().sum() == 1 and grad_var[1, 2, 3].isnan()


@pytest.mark.parametrize("legacy", [None, (False, None), (None, False)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize(("log_input", "full"), list(itertools.product([True, False], [True, False])))
def test_poisson_matches_torch(log_input, full, reduction, legacy):
    input = (heavy_tailed(SHAPE).clamp(-5, 5) if log_input else torch.rand(SHAPE) * 4).requires_grad_()
    target = torch.poisson(torch.rand(SHAPE) * 5).requires_grad_()
    size_average, reduce = legacy or (None, None)
    kwargs = dict(log_input=log_input, full=full, size_average=size_average, reduce=reduce, reduction=reduction)
    out, expected = fusedloss.poisson_nll_loss(input, target, **kwargs), F.poisson_nll_loss(input, target, **kwargs)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    # weight= takes the fused route's way through (the loss per element, then the reduction)
    if reduce is None:
        weighted = fusedloss.poisson_nll_loss(input, target, weight=torch.ones(()), **kwargs)
        torch.testing.assert_close(weighted, expected, rtol=2e-6, atol=1e-6)
    assert _error_of(fusedloss.poisson_nll_loss, input, target, reduction="bogus") == \
        _error_of(F.poisson_nll_loss, input, target, reduction="bogus")


def _float64_loss(name, input, target, var):
    if name == "gaussian":
        return F.gaussian_nll_loss(input.double(), target.double(), var.double(), full=True, reduction="none")
    return F.poisson_nll_loss(input.double(), target.double(), full=True, reduction="none")


def _call(name, input, target, var, **kwargs):
    if name == "gaussian":
        return fusedloss.gaussian_nll_loss(input, target, var, full=True, **kwargs)
    return fusedloss.poisson_nll_loss(input, target, full=True, **kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("weight_shape", [None, (4, 1, 1), (6,), SHAPE])
@pytest.mark.parametrize("dim", [None, (1, 2), 0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["gaussian", "poisson"])
def test_weight_scale_and_dim(device, name, reduction, dim, weight_shape):
    input = heavy_tailed(SHAPE, device=device).clamp(-5, 5).requires_grad_()
    target = heavy_tailed(SHAPE, device=device) if name == "gaussian" else \
        torch.poisson(torch.rand(SHAPE, device=device) * 5)
    var = (torch.rand(SHAPE[:-1], device=device) + 0.1).requires_grad_()
    weight = None if weight_shape is None else (torch.rand(weight_shape, device=device) + 0.25).requires_grad_()
    out = _call(name, input, target, var, reduction=reduction, weight=weight, scale=0.37, dim=dim)
    leaves64 = [t.detach().double().requires_grad_() for t in (input, var)]
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    per_element = _float64_loss(name, leaves64[0], target, leaves64[1])
    dims = tuple(range(3)) if dim is None else dim
    weighted = per_element if w64 is None else per_element * w64
    expected = weighted.sum(dims)
    if reduction == "mean":
        expected = expected / (math.prod(SHAPE[d] for d in ((dims,) if isinstance(dims, int) else dims))
                               if w64 is None else w64.expand(SHAPE).sum(dims))
    expected = expected * 0.37
    rtol, atol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected.detach(), rtol=rtol * 4, atol=atol * 4)
    wrt = [input] + ([var] if name == "gaussian" else []) + ([weight] if weight is not None else [])
    wrt64 = [leaves64[0]] + ([leaves64[1]] if name == "gaussian" else []) + ([w64] if weight is not None else [])
    grad_output = torch.rand_like(expected) + 0.5
    # a weighted mean's weight gradient sums terms of the loss's size that cancel: its error is theirs
    magnitude = max(expected.abs().max().item(), 1.0)
    for g, w in zip(torch.autograd.grad(out, wrt, grad_output.float()), torch.autograd.grad(expected, wrt64, grad_output)):
        torch.testing.assert_close(g.double(), w, rtol=rtol * 8, atol=atol * 8 * max(w.abs().max().item(), magnitude))


@pytest.mark.parametrize("name", ["gaussian_nll_loss", "poisson_nll_loss"])
def test_pytorch_opinfo_samples(pytorch_test_db, name):
    """Every sample on both of the Gaussian loss's routes: values and gradients, bit for bit."""
    op_db, _ = pytorch_test_db
    (opinfo,) = [op for op in op_db if op.name == "nn.functional." + name and op.variant_test_name == ""]
    count = 0
    for dtype in (torch.float32, torch.float64):
        for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=True):
            args = (sample.input, *sample.args)
            expected = getattr(F, name)(*args, **sample.kwargs)
            routes = [getattr(fusedloss, name)]
            if name == "gaussian_nll_loss" and isinstance(args[2], torch.Tensor):
                routes.append(_no_sync)
            for fn in routes:
                out = fn(*args, **sample.kwargs)
                assert out.dtype == expected.dtype and torch.equal(out, expected), (fn, sample)
                tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                grad_output = torch.ones_like(out)
                got = torch.autograd.grad(out, tensors, grad_output, allow_unused=True)
                want = torch.autograd.grad(expected, tensors, grad_output, allow_unused=True, retain_graph=True)
                for g, w in zip(got, want):
                    assert (g is None and w is None) or torch.equal(g, w)
            count += 1
    assert count >= 4


@pytest.mark.parametrize("kwargs", [{}, {"full": True, "eps": 1e-3, "reduction": "sum"}])
def test_gaussian_module(kwargs):
    ours, theirs = fusedloss.nn.GaussianNLLLoss(**kwargs), torch.nn.GaussianNLLLoss(**kwargs)
    assert isinstance(ours, torch.nn.GaussianNLLLoss) and repr(ours) == repr(theirs)
    x, y, var = heavy_tailed(SHAPE), heavy_tailed(SHAPE), torch.rand(SHAPE[:-1])
    assert torch.equal(ours(x, y, var), theirs(x, y, var))
    torch.testing.assert_close(ours(x, y, var, dim=(1, 2), scale=2.0),
                               fusedloss.gaussian_nll_loss(x, y, var, dim=(1, 2), scale=2.0, **kwargs))


@pytest.mark.parametrize("kwargs", [{}, {"log_input": False, "full": True, "reduction": "sum"}])
def test_poisson_module(kwargs):
    ours, theirs = fusedloss.nn.PoissonNLLLoss(**kwargs), torch.nn.PoissonNLLLoss(**kwargs)
    assert isinstance(ours, torch.nn.PoissonNLLLoss) and repr(ours) == repr(theirs)
    x, y = torch.rand(SHAPE) * 3, torch.poisson(torch.rand(SHAPE) * 3)
    assert torch.equal(ours(x, y), theirs(x, y))
    weight = torch.rand(6)
    torch.testing.assert_close(ours(x, y, weight, dim=0), fusedloss.poisson_nll_loss(x, y, weight=weight, dim=0,
                                                                                       **kwargs))


@requires_cuda
def test_cuda_gaussian_takes_no_host_sync():
    """F.gaussian_nll_loss's torch.any(var < 0) waits for the GPU; this route does not,
    forward or backward, and gives NaN where var is negative."""
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    y = torch.randn(64, 1024, device="cuda")
    var = (torch.rand(64, 1, device="cuda") + 0.1).requires_grad_()
    expected = F.gaussian_nll_loss(x, y, var)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fusedloss.gaussian_nll_loss(x, y, var)
        out.backward()
        negative = fusedloss.gaussian_nll_loss(x, y, var.detach() - 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, expected)
    assert negative.isnan()
