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
from fusedloss import build, grad_output_prediction, likelihood, routing

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
    torch.testing.assert_close(out, expected)  # the written-out route rounds a product once
    assert negative.isnan()
    # the fused route (a var of the input's shape), forward and backward
    var = var.detach().expand_as(x).contiguous().requires_grad_()
    expected = F.gaussian_nll_loss(x, y, var)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fusedloss.gaussian_nll_loss(x, y, var)
        (out * 0.37).backward()
        negative = fusedloss.gaussian_nll_loss(x, y, var.detach() - 1.0, reduction="sum")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, expected)
    assert negative.isnan() and var.grad.isfinite().all()


# ---- the written-out autograd functions (the GPU's eager route) ------------------------------

GRAD_OUTPUTS = [1.0, 0.37, 1000.0, 2.0**16]
WRITTEN_OUT_DTYPES = [(torch.float32,) * 3, (torch.float64,) * 3, (torch.bfloat16,) * 3,
                      (torch.float32, torch.float64, torch.float32), (torch.float64, torch.float32, torch.float32),
                      (torch.bfloat16, torch.float32, torch.bfloat16)]


def _written_out(name, input, target, var, reduction, full=False):
    """The function the GPU's eager route applies, called on any device ("poisson": of a log
    rate, "poisson rate": of a rate)."""
    if name.startswith("poisson"):
        return likelihood.PoissonNll.apply(input, target, name == "poisson", 1e-8, reduction)
    return likelihood.GaussianNll.apply(input, target, likelihood._broadcastable_var(input, var), full, 1e-6, reduction)


def _pytorch(name, input, target, var, reduction, full=False):
    if name.startswith("poisson"):
        return F.poisson_nll_loss(input, target, log_input=name == "poisson", full=full, reduction=reduction)
    return F.gaussian_nll_loss(input, target, var, full=full, reduction=reduction)


def _likelihood_operands(name, shape, dtypes, device, var_shape=None):
    """A log rate within (-6, 6) (a rate within [0, 8), zeros among them) and counts, or
    heavy-tailed values and a var with entries at and below eps: every branch of the clamp."""
    if name.startswith("poisson"):
        input = torch.rand(shape, device=device, dtype=torch.float64) * 12 - 6
        if name == "poisson rate":
            input = (input + 6).mul_(2 / 3).masked_fill_(input < -5.5, 0)
        target = torch.poisson(torch.rand(shape, device=device, dtype=torch.float64) * 8)
        var = None
    else:
        input, target = heavy_tailed(shape, device=device), heavy_tailed(shape, device=device)
        var = torch.rand(var_shape or shape, device=device, dtype=torch.float64) * 2
        if var.numel() >= 2:
            var.view(-1)[:2] = torch.tensor([0.0, 1e-9])
        var = var.to(dtypes[2]).requires_grad_()
    return input.to(dtypes[0]).requires_grad_(), target.to(dtypes[1]).requires_grad_(), var


def _same_bits(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _errors_within_pytorchs(got, pytorch, exact, magnitude, dtypes, what):
    """Each element's error against float64 within PyTorch's own error for it plus the
    dtype's tolerance of the terms' magnitude (the sum of their absolute values: a
    difference of large terms carries their rounding): the written-out route rounds no
    more often than PyTorch's formula."""
    __tracebackhide__ = True
    rtol, atol = (max(TOLERANCE[d][k] for d in dtypes) for k in (0, 1))  # the narrowest dtype's
    got, pytorch = got.double(), pytorch.double()
    finite = exact.isfinite() & pytorch.isfinite()
    assert torch.equal(got.isnan() & finite, pytorch.isnan() & finite), f"{what}: NaN where PyTorch has none"
    bound = (pytorch - exact).abs() + rtol * (exact.abs() + magnitude) + atol
    error = (got - exact).abs()
    bad = finite & ~(error <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {error[bad].max().item():.3g}"


def _magnitudes(name, input, target, var, reduction, grad_output):
    """In float64, the sum of the absolute values of the terms of the loss and of each
    gradient (for the leaves input, target and var), times |grad_output| (over N for a mean)."""
    x, t = input.detach().double(), target.detach().double()
    scale = grad_output.abs() / (torch.broadcast_shapes(x.shape, t.shape).numel() if reduction == "mean" else 1)
    if name == "poisson":
        rate = x.exp()
        value = rate + (t * x).abs()
        grads = [(rate + t.abs()) * scale, x.abs() * scale]
    elif name == "poisson rate":
        log_shifted = (x + 1e-8).log()
        value = x.abs() + (t * log_shifted).abs()
        grads = [(1 + (t / (x + 1e-8)).abs()) * scale, log_shifted.abs() * scale]
    else:
        v = likelihood._broadcastable_var(x, var.detach().double()).clamp(min=1e-6)
        q = (x - t) / v
        value = 0.5 * (v.log().abs() + q * (x - t))
        grads = [q.abs() * scale, q.abs() * scale, (0.5 * (1 / v + q * q) * scale).sum_to_size(var.shape)]
        grads[2] = grads[2].reshape(var.shape)
    value = {"none": value, "mean": value.mean(), "sum": value.sum()}[reduction]
    return value, [g.sum_to_size(leaf.shape) for g, leaf in zip(grads, (input, target, var))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("grad_output", GRAD_OUTPUTS)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtypes", WRITTEN_OUT_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_written_out_matches_float64_as_pytorch_does(device, name, dtypes, reduction, grad_output):
    """Values and every gradient, against float64, on 2^20 + 3 elements (the Gaussian's var
    one per row), within the error of PyTorch's own formula in those dtypes; the same bits
    on a second run."""
    shape = (1025, 1023)
    input, target, var = _likelihood_operands(name, shape, dtypes, device, var_shape=(1025, 1))
    _check_against_float64(_written_out, name, input, target, var, reduction, grad_output)


def _check_against_float64(fn, name, input, target, var, reduction, grad_output):
    """fn's value and every gradient against float64, within the error of PyTorch's own
    formula in these dtypes; the same bits on a second run."""
    __tracebackhide__ = True
    leaves = [t for t in (input, target, var) if t is not None]
    out = fn(name, input, target, var, reduction)
    again = fn(name, input, target, var, reduction)
    expected = _pytorch(name, input, target, var, reduction)
    exact = _pytorch(name, *(None if t is None else t.double() for t in (input, target, var)), reduction)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    _same_bits(out, again)
    g = torch.full_like(out, min(grad_output, 2.0**15 if out.dtype == torch.float16 else grad_output))
    dtypes = (out.dtype, torch.promote_types(input.dtype, target.dtype))
    magnitude, grad_magnitudes = _magnitudes(name, input, target, var, reduction, g.double())
    _errors_within_pytorchs(out.detach(), expected.detach(), exact.detach(), magnitude, dtypes, "value")
    got = torch.autograd.grad(out, leaves, g)
    for a, b in zip(got, torch.autograd.grad(again, leaves, g)):
        _same_bits(a, b)
    want = torch.autograd.grad(expected, leaves, g)
    want64 = torch.autograd.grad(exact, leaves, g.double())
    for leaf, a, b, c, m in zip(leaves, got, want, want64, grad_magnitudes):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape
        _errors_within_pytorchs(a, b, c, m, (a.dtype, *dtypes), f"gradient of a {tuple(leaf.shape)} operand")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_written_out_edges(device, name):
    """Empty, 0-d and broadcast operands, NaN and inf, a double backward, and the full form."""
    for shape, target_shape in [((0, 3), (0, 3)), ((), ()), ((4, 5), (5,)), ((4, 1), (4, 5))]:
        for reduction in ("none", "mean", "sum"):
            input, _, var = _likelihood_operands(name, shape, (torch.float64,) * 3, device)
            _, target, _ = _likelihood_operands(name, target_shape, (torch.float64,) * 3, device)
            out, expected = (f(name, input, target, var, reduction) for f in (_written_out, _pytorch))
            torch.testing.assert_close(out, expected, equal_nan=True)
            leaves = [t for t in (input, target, var) if t is not None]
            grads = torch.autograd.grad(out.sum(), leaves, create_graph=True)
            wants = torch.autograd.grad(expected.sum(), leaves, create_graph=True)
            for a, b in zip(grads, wants):
                torch.testing.assert_close(a, b, equal_nan=True)
            if out.numel():  # the double backward differentiates PyTorch's formula
                for a, b in zip(torch.autograd.grad(grads[0].sum(), leaves, allow_unused=True),
                                torch.autograd.grad(wants[0].sum(), leaves, allow_unused=True)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b, equal_nan=True)
    special = torch.tensor([math.nan, math.inf, -math.inf, 1.0, 100.0, -100.0], device=device, dtype=torch.float64)
    counts = torch.tensor([1.0, 0.0, 2.0, math.nan, math.inf, 3.0], device=device, dtype=torch.float64)
    var = torch.tensor([1.0, 2.0, 0.5, 1.0, math.inf, 0.0], device=device, dtype=torch.float64)
    torch.testing.assert_close(_written_out(name, special, counts, var, "none"),
                               _pytorch(name, special, counts, var, "none"), equal_nan=True)
    if name == "gaussian":
        torch.testing.assert_close(_written_out(name, special, counts, var, "none", full=True),
                                   _pytorch(name, special, counts, var, "none", full=True), equal_nan=True)


def _route_ops(fn):
    """The names of the ATen operators a call runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn()
    return record.ops


@requires_cuda
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_eager_takes_the_written_out_route_and_modes_take_pytorchs(name):
    """Eager CUDA calls (autocast too) take the written-out functions, with PyTorch's dtypes;
    torch.func transforms and compile run PyTorch's formula, bit for bit."""
    # the Poisson loss's written-out function from POISSON_WRITTEN_OUT_FROM_BYTES of operands
    rows = likelihood.POISSON_WRITTEN_OUT_FROM_BYTES // (2 * 64 * 4) if name.startswith("poisson") else 64
    input, target, var = _likelihood_operands(name, (rows, 64), (torch.float32,) * 3, "cuda", var_shape=(rows, 1))
    if name.startswith("poisson"):
        def ours(i, t):
            return fusedloss.poisson_nll_loss(i, t, log_input=name == "poisson")

        def theirs(i, t):
            return F.poisson_nll_loss(i, t, log_input=name == "poisson")
    else:
        def ours(i, t):
            return fusedloss.gaussian_nll_loss(i, t, var)

        def theirs(i, t):
            return F.gaussian_nll_loss(i, t, var)
    # operands of one shape take the fused kernels; a var per row the written-out function
    route = _route_ops(lambda: ours(input, target))
    assert (("likelihood_loss.default" in route) == name.startswith("poisson")
            and ("addcmul.default" in route) == (name == "gaussian"))
    if name.startswith("poisson"):
        # below it, the fused pass still takes operands of one shape and dtype; PyTorch's operations others
        assert "likelihood_loss.default" in _route_ops(lambda: ours(input[:-1], target[:-1]))
        small = _route_ops(lambda: ours(input[:64], target[:64].double()))
        assert "likelihood_loss.default" not in small and "addcmul.default" not in small
        # reduction='none' takes it from there only, PyTorch's operations below
        none = _route_ops(lambda: fusedloss.poisson_nll_loss(input, target, log_input=name == "poisson",
                                                              reduction="none"))
        assert "likelihood_pointwise.default" in none and "addcmul.default" not in none
        none = _route_ops(lambda: fusedloss.poisson_nll_loss(input[:-1], target[:-1], log_input=name == "poisson",
                                                              reduction="none"))
        assert "likelihood_pointwise.default" not in none and "addcmul.default" not in none
    else:
        route = _route_ops(lambda: fusedloss.gaussian_nll_loss(input, target, var.expand_as(input).contiguous()))
        assert "likelihood_loss.default" in route and "addcmul.default" not in route
    # bfloat16 operands take it too (float32's range); float16 ones keep PyTorch's formula
    for dtype, taken in ((torch.bfloat16, True), (torch.float16, False)):
        i, t = (x.detach().to(dtype) for x in (input, target))
        if name.startswith("poisson"):  # as many bytes as the float32 operands above
            i, t = torch.cat([i, i]), torch.cat([t, t])
        route = _route_ops(lambda: ours(i, t))
        assert ("addcmul.default" in route or "likelihood_loss.default" in route) == taken, dtype
    for dtype in (torch.bfloat16, torch.float16):
        i, t = input.detach().to(dtype), target.to(dtype)
        with torch.autocast("cuda", dtype=dtype):
            got, want = ours(i, t), theirs(i, t)
        assert got.dtype == want.dtype
        # autocast computes some of PyTorch's steps in the 16-bit dtype: at most their error
        # against the float64 formula on the same operands, or 1e-5 of it
        if name == "gaussian":
            exact = F.gaussian_nll_loss(i.double(), t.double(), var.detach().double())
        else:
            exact = F.poisson_nll_loss(i.double(), t.double(), log_input=name == "poisson")
        allowed = max(abs(want.double() - exact).item(), 1e-5 * abs(exact).item(), 1e-6)
        assert abs(got.double() - exact).item() <= allowed, (dtype, got, want, exact)
    grad = torch.func.grad(ours)(input.detach(), target)
    assert torch.equal(grad, torch.func.grad(theirs)(input.detach(), target))
    primal, tangent = (input.detach(),), (torch.randn_like(input),)
    got = torch.func.jvp(lambda i: ours(i, target), primal, tangent)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.func.jvp(lambda i: theirs(i, target), primal, tangent)))
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(input, target), theirs(input, target))


@requires_cuda
@pytest.mark.parametrize(("name", "var_columns"), [("poisson", None), ("gaussian", 1), ("gaussian", 64)])
def test_cuda_graph_replays_the_eager_step(name, var_columns):
    """A captured step (loss and backward) replays the eager step's bits with new operands:
    the fused route (the Poisson loss, a var of the input's shape) and the written-out one."""
    shape = (likelihood.POISSON_WRITTEN_OUT_FROM_BYTES // (2 * 64 * 4) + 1, 64)
    var_shape = (shape[0], var_columns or 1)
    input, target, var = _likelihood_operands(name, shape, (torch.float32,) * 3, "cuda", var_shape=var_shape)
    loss = (lambda i, t: fusedloss.poisson_nll_loss(i, t)) if name == "poisson" else \
        (lambda i, t: fusedloss.gaussian_nll_loss(i, t, var))
    leaves = [t for t in (input, target, var) if t is not None]

    def step():
        for leaf in leaves:
            leaf.grad = None
        out = loss(input, target)
        out.backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = _likelihood_operands(name, shape, (torch.float32,) * 3, "cuda", var_shape=var_shape)
    with torch.no_grad():
        for leaf, new in zip(leaves, [t for t in fresh if t is not None]):
            leaf.copy_(new)
    graph.replay()
    replayed = (captured.clone(), *(leaf.grad.clone() for leaf in leaves))
    eager = step()
    expected = (eager.detach(), *(leaf.grad for leaf in leaves))
    for a, b in zip(replayed, expected):
        _same_bits(a, b)


# ---- the fused kernels: a mean or sum of operands of one dtype and one shape on a GPU ------------

_KINDS = {"poisson": "poisson", "poisson rate": "poisson_rate", "gaussian": "gaussian"}


def _fused(name, input, target, var, reduction, full=False, autograd="python", scale=1.0):
    """The fused pass with one of its autograds, as the GPU's eager route applies it (which
    loads its kernels): ``FusedLikelihood`` ("python") or the C++ autograd's node ("cxx")."""
    build.load("likelihood")
    if reduction == "none":
        return likelihood.FusedLikelihoodPointwise.apply(input, target, var if name == "gaussian" else None,
                                                         _KINDS[name], 1e-6 if name == "gaussian" else 1e-8, full,
                                                         scale)
    # no history slot, a grad_output of 1 expected, the gradients written in the forward
    args = (input, target, var if name == "gaussian" else None, _KINDS[name], 1e-6 if name == "gaussian" else 1e-8,
            full, reduction, -1, 1.0, True, scale)
    if autograd == "cxx":
        return torch.ops.fusedloss_cxx.likelihood_loss.default(*args)
    return likelihood.FusedLikelihood.apply(*args)


@pytest.fixture(params=["python", "cxx"])
def autograd(request):
    """Each autograd of the fused pass: the C++ one compiled where it is not cached."""
    if request.param == "cxx":
        request.getfixturevalue("cxx_autograd")
    return request.param


@requires_cuda
@pytest.mark.parametrize("grad_output", GRAD_OUTPUTS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_fused_matches_float64_as_pytorch_does(name, dtype, reduction, grad_output):
    """The public functions on the fused route (checked to be taken) for operands from where
    it starts (2^20 + 3 elements, the Poisson loss's from POISSON_WRITTEN_OUT_FROM_BYTES): the
    value and every gradient against float64, within PyTorch's own error plus the dtype's
    tolerance, for grad_outputs that are not 1 too; the same bits on a second run."""
    size = torch.empty((), dtype=dtype).element_size()
    rows = likelihood.POISSON_WRITTEN_OUT_FROM_BYTES // (2 * 1023 * size) + 1 if name != "gaussian" else 1025
    input, target, var = _likelihood_operands(name, (rows, 1023), (dtype,) * 3, "cuda")

    def public(name, input, target, var, reduction):
        if name == "gaussian":
            return fusedloss.gaussian_nll_loss(input, target, var, reduction=reduction)
        return fusedloss.poisson_nll_loss(input, target, log_input=name == "poisson", reduction=reduction)

    assert "likelihood_loss.default" in _route_ops(lambda: public(name, input, target, var, reduction))
    _check_against_float64(public, name, input, target, var, reduction, grad_output)


@requires_cuda
@pytest.mark.parametrize("scale", [0.37, 65536.0])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_fused_full_and_scale(name, dtype, reduction, scale, monkeypatch):
    """The public functions with ``full`` and a number ``scale`` take the fused route
    (checked): the value and each gradient (grad_output 0.37; for ``'none'`` one per
    element, and 0.37 expanded, as a sum's backward brings it) against PyTorch's formula in
    float64 times the scale, within the dtype's tolerance of their largest entry, NaN where
    PyTorch's is (the target's gradient at a count of 0); counts above 1 take the Poisson
    loss's Stirling term and its gradient in the target."""
    input, target, var = _likelihood_operands(name, (301, 129), (dtype,) * 3, "cuda")
    leaves = [t for t in (input, target, var) if t is not None]
    monkeypatch.setattr(likelihood, "POISSON_WRITTEN_OUT_FROM_BYTES", 0)  # the Poisson 'none' at this size too

    def ours():
        if name == "gaussian":
            return fusedloss.gaussian_nll_loss(input, target, var, full=True, reduction=reduction, scale=scale)
        return fusedloss.poisson_nll_loss(input, target, log_input=name == "poisson", full=True, reduction=reduction,
                                          scale=scale)

    assert ("likelihood_pointwise.default" if reduction == "none" else "likelihood_loss.default") in _route_ops(ours)
    out = ours()
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    exact = _pytorch(name, *(*leaves64, None)[:3], reduction, full=True) * scale
    assert out.dtype == dtype and out.shape == exact.shape
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), exact.detach(), rtol=rtol, atol=atol * exact.abs().max().item())
    grad_outputs = [torch.tensor(0.37, device="cuda", dtype=dtype)]
    if reduction == "none":
        grad_outputs = [torch.rand_like(out) + 0.5, grad_outputs[0].expand_as(out)]
    for grad_output in grad_outputs:
        for got, want in zip(torch.autograd.grad(out, leaves, grad_output, retain_graph=True),
                             torch.autograd.grad(exact, leaves64, grad_output.double(), retain_graph=True)):
            largest = want[want.isfinite()].abs().max().item()
            torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * largest, equal_nan=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_fused_operators_match_pytorch(device, name):
    """The fused operators (the CPU kernels that DTensor ranks on the CPU run, and the CUDA
    ones) called directly: PyTorch's values and gradients (float64 operands with NaN, inf, 0
    and counts about 1 among them; the var at and below eps, not negative, where PyTorch's CPU
    raises), every reduction, with and without ``full``, a scale of 0.37, the forward's
    gradients for an expected grad_output of 2, and the backward's for another."""
    ops_ = torch.ops.fusedloss
    if device == "cuda":
        build.load("likelihood")
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0, 100.0, -100.0, 1e-30], dtype=torch.float64)
    counts = torch.tensor([1.0, 0.0, 2.0, math.nan, math.inf, 3.0, 0.5, 7.0], dtype=torch.float64)
    variances = torch.tensor([1.0, 2.0, 0.5, 1.0, math.inf, 0.0, 1e-9, math.nan], dtype=torch.float64)
    operands = _likelihood_operands(name, (40, 33), (torch.float64,) * 3, "cpu")
    kind, eps = _KINDS[name], 1e-6 if name == "gaussian" else 1e-8
    for (x, t, v), full, reduction in itertools.product(((special, counts, variances), operands), (False, True),
                                                        ("none", "mean", "sum")):
        leaves = [a.detach().to(device).requires_grad_() for a in (x, t, v)[:3 if name == "gaussian" else 2]]
        input, target, var = (*leaves, None)[:3]
        expected = _pytorch(name, input, target, var, reduction, full) * 0.37
        detached = [a.detach() for a in (input, target)] + [None if var is None else var.detach()]
        mask = [True, True, var is not None]
        if reduction == "none":
            out = ops_.likelihood_pointwise(*detached, kind, eps, full, 0.37)
            go = torch.rand_like(out) + 0.5
            grads = ops_.likelihood_pointwise_backward(go, *detached, kind, eps, full, mask, 0.37)
        else:
            out, *written = ops_.likelihood_loss(*detached, kind, eps, full, reduction, mask, 2.0, 0.37)
            go = torch.tensor(3.0, dtype=out.dtype, device=device)
            grads = ops_.likelihood_loss_backward(go, *detached, kind, eps, full, reduction, mask, -1, 2.0, 0.37)
            for a, b in zip(written, torch.autograd.grad(expected, leaves, torch.full_like(expected, 2.0),
                                                         retain_graph=True)):
                torch.testing.assert_close(a, b, equal_nan=True)
        torch.testing.assert_close(out, expected.detach(), equal_nan=True)
        for a, b in zip(grads, torch.autograd.grad(expected, leaves, go)):
            torch.testing.assert_close(a, b, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_fused_pointwise_edges(name):
    """reduction='none' on the fused route: PyTorch's value for each of NaN, inf, 0 and
    counts at, below and above 1 (with ``full``, and without), for empty operands too; the
    gradients for a grad_output of ones, materialized and expanded, with the bits of the
    sum's fused backward; a double backward differentiates PyTorch's formula; the same bits
    on a second run."""
    special = [math.nan, math.inf, -math.inf, 0.0, 1.0, 100.0, -100.0, 1e-30]
    counts = [1.0, 0.0, 2.0, math.nan, math.inf, 3.0, 0.5, 7.0]
    variances = [1.0, 2.0, 0.5, 1.0, math.inf, 0.0, 1e-9, math.nan]
    edges = [torch.tensor(v, device="cuda", dtype=torch.float64) for v in (special, counts, variances)]
    for operands, full in itertools.product((edges, _likelihood_operands(name, (0, 3), (torch.float64,) * 3, "cuda"),
                                             _likelihood_operands(name, (40, 33), (torch.float64,) * 3, "cuda")),
                                            (False, True)):
        leaves = [t.detach().requires_grad_() for t in operands[:3 if name == "gaussian" else 2]]
        input, target, var = (*leaves, None)[:3]
        out = _fused(name, input, target, var, "none", full)
        torch.testing.assert_close(out, _pytorch(name, input, target, var, "none", full), equal_nan=True)
        _same_bits(out, _fused(name, input, target, var, "none", full))
        summed = torch.autograd.grad(_fused(name, input, target, var, "sum", full), leaves)
        for ones in (torch.ones_like(out), torch.ones((), device="cuda", dtype=out.dtype).expand_as(out)):
            for a, b in zip(torch.autograd.grad(out, leaves, ones, retain_graph=True), summed):
                _same_bits(a, b)
        if out.numel():
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out), create_graph=True)
            expected = _pytorch(name, input, target, var, "none", full)
            wants = torch.autograd.grad(expected, leaves, torch.ones_like(expected), create_graph=True)
            for a, b in zip(torch.autograd.grad(grads[0].sum(), leaves, allow_unused=True),
                            torch.autograd.grad(wants[0].sum(), leaves, allow_unused=True)):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_fused_edges(name, autograd):
    """PyTorch's values and gradients for each of NaN, inf, 0 (a var of 0, inf and below eps)
    alone, for empty and 0-d operands, with ``full``; a double backward differentiates
    PyTorch's formula; a second backward (retain_graph) gives the first one's bits. Counts
    at, below and above 1 take each side of the Poisson loss's Stirling term."""
    special = [math.nan, math.inf, -math.inf, 0.0, 1.0, 100.0, -100.0, 1e-30]
    counts = [1.0, 0.0, 2.0, math.nan, math.inf, 3.0, 0.5, 7.0]
    variances = [1.0, 2.0, 0.5, 1.0, math.inf, 0.0, 1e-9, math.nan]
    cases = [torch.tensor(v, device="cuda", dtype=torch.float64) for v in zip(special, counts, variances)]
    cases = [c.unbind() for c in cases]
    for shape in ((0, 3), (4, 5)):
        cases.append(_likelihood_operands(name, shape, (torch.float64,) * 3, "cuda"))
    for reduction, full in itertools.product(("mean", "sum"), (False, True)):
        for operands in cases:
            leaves = [t.detach().requires_grad_() for t in operands[:3 if name == "gaussian" else 2]]
            input, target, var = (*leaves, None)[:3]
            out = _fused(name, input, target, var, reduction, full, autograd)
            expected = _pytorch(name, input, target, var, reduction, full)
            torch.testing.assert_close(out, expected, equal_nan=True)
            grads = torch.autograd.grad(out, leaves, create_graph=True)
            wants = torch.autograd.grad(expected, leaves, create_graph=True)
            for a, b in zip(grads, wants):
                torch.testing.assert_close(a, b, equal_nan=True)
            if input.numel() and grads[0].requires_grad:
                for a, b in zip(torch.autograd.grad(grads[0].sum(), leaves, allow_unused=True),
                                torch.autograd.grad(wants[0].sum(), leaves, allow_unused=True)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b, equal_nan=True)
            out = _fused(name, input, target, var, reduction, full, autograd)
            first = torch.autograd.grad(out, leaves, torch.tensor(0.37, device="cuda", dtype=out.dtype),
                                        retain_graph=True)
            second = torch.autograd.grad(out, leaves, torch.tensor(0.37, device="cuda", dtype=out.dtype))
            for a, b in zip(first, second):
                _same_bits(a, b)


@requires_cuda
@pytest.mark.parametrize("grad_output", [1.0, 0.37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_both_autograds_give_the_same_bits(cxx_autograd, name, dtype, grad_output):
    """The C++ autograd's node and FusedLikelihood: the same values and gradients, bit for
    bit, for every subset of the operands that want gradients and of those asked for, a
    second backward (retain_graph) too; the public functions take the node where it is loaded."""
    input, target, var = _likelihood_operands(name, (257, 33), (dtype,) * 3, "cuda")
    operands = (input, target, var) if name == "gaussian" else (input, target)
    for reduction, (full, scale) in itertools.product(("mean", "sum"), ((False, 1.0), (True, 0.37))):
        for wanted in itertools.product((False, True), repeat=len(operands)):
            if not any(wanted):
                continue
            leaves = [t.detach().requires_grad_(w) for t, w in zip(operands, wanted)]
            asked = [t for t in leaves if t.requires_grad]
            for ask in (asked, asked[:1]):
                results = []
                for autograd in ("python", "cxx"):
                    out = _fused(name, *(*leaves, None)[:3], reduction, full, autograd, scale)
                    go = torch.tensor(grad_output, device="cuda", dtype=out.dtype)
                    first = torch.autograd.grad(out, ask, go, retain_graph=True)
                    second = torch.autograd.grad(out, ask, go)
                    results.append((out.grad_fn.name(), out.detach(), *first, *second))
                (python_node, *python), (cxx_node, *cxx) = results
                assert cxx_node == "LikelihoodBackward" and python_node != cxx_node
                for a, b in zip(python, cxx):
                    _same_bits(a, b)
    leaves = [t.detach().requires_grad_() for t in operands]
    if name == "gaussian":
        out = fusedloss.gaussian_nll_loss(*leaves)
    else:
        out = fusedloss.poisson_nll_loss(*leaves, log_input=name == "poisson")
    assert out.grad_fn.name() == "LikelihoodBackward"


@requires_cuda
@pytest.mark.parametrize("grad_scale", [0.37, 65536.0])
@pytest.mark.parametrize("name", ["poisson", "poisson rate", "gaussian"])
def test_cuda_fused_forward_predicts_grad_output(name, grad_scale, autograd, monkeypatch):
    """From FUSED_GRADIENT_FROM_BYTES of operands, the fused forward writes the gradients for
    the grad_output the last backward of the same loss noted (a loss scale then costs no
    second pass): predicted, corrected for another, computed in backward after a
    misprediction, and below that size, with the same bits; each backward notes what it saw."""
    build.load("likelihood")
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: autograd == "cxx")
    input, target, var = _likelihood_operands(name, (257, 389), (torch.float32,) * 3, "cuda")
    kind, eps = _KINDS[name], 1e-6 if name == "gaussian" else 1e-8
    operands = [t for t in (input, target, var) if t is not None]
    history = grad_output_prediction._history_table("likelihood")
    routes = {"predicted": (0, grad_scale, False), "corrected": (0, grad_scale * 3 + 1, False),
              "after a misprediction": (0, grad_scale, True), "below": (1 << 62, None, False)}
    results = {}
    out = None
    for route, (threshold, noted, mispredicted) in routes.items():
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        out = None  # the last route's graph and operands freed before counting this one's memory
        leaves = [t.detach().clone().requires_grad_() for t in operands]
        slot = grad_output_prediction.history_slot(kind, eps, "mean", *leaves[:2], *leaves[2:], family="likelihood")
        if noted is not None:
            torch.cuda.synchronize()
            history[2 * slot], history[2 * slot + 1] = noted, float(mispredicted)
        before = torch.cuda.memory_allocated()
        if name == "gaussian":
            out = fusedloss.gaussian_nll_loss(*leaves)
        else:
            out = fusedloss.poisson_nll_loss(*leaves, log_input=name == "poisson")
        # a forward that writes the gradients holds them
        held = torch.cuda.memory_allocated() - before
        assert (held >= input.numel() * 4) == (route != "after a misprediction"), route
        grads = torch.autograd.grad(out, leaves, torch.tensor(grad_scale, device="cuda"))
        results[route] = (out.detach(), *grads)
        if noted is not None:
            torch.cuda.synchronize()
            assert history[2 * slot] == torch.tensor(grad_scale, dtype=torch.float32).item(), route
            assert history[2 * slot + 1] == float(route == "corrected"), route
    for route, result in results.items():
        for got, want in zip(result, results["below"]):
            _same_bits(got, want)
