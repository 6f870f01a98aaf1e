"""dim= and keepdim (every loss): the loss reduced over some dimensions only, as
torch.mean and torch.sum reduce, composed with weight= and scale=; checked against the
float64 formula reduced by torch, values and gradients, on every route."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import LOSSES, PARAMS, TOLERANCE, float64_reference, heavy_tailed, loss_kwargs, requires_cuda

import fusedloss
from fusedloss import losses

SHAPE = (3, 4, 5, 6)
DIMS = [0, -1, (1, 2, 3), (0, 2), [3, 1], (0, 1, 2, 3)]


def _call(name, input, target, **kwargs):
    fn, _, _ = LOSSES[name]
    return fn(input, target, **loss_kwargs(name, PARAMS[name]), **kwargs)


def _expected(name, input, target, reduction, dims, keepdim=False, weight=None, scale=None):
    """The float64 loss per element, weighted, reduced over `dims` by torch, scaled."""
    per_element = float64_reference(name, input, target, "none", PARAMS[name])
    if weight is not None:
        per_element = per_element * weight.double()
    out = per_element.sum(dims, keepdim=keepdim)
    if reduction == "mean":
        if weight is None or losses.LOSSES[name].weighted_mean_over_count:
            out = out / math.prod(per_element.shape[d] for d in ((dims,) if isinstance(dims, int) else dims))
        else:
            out = out / weight.double().expand(per_element.shape).sum(dims, keepdim=keepdim)
    return out if scale is None else out * float(scale)


def _close(actual, expected64, dtype=torch.float32, bound=1.0):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=rtol * 4, atol=atol * 4 * bound, equal_nan=True)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_per_sample_values_and_gradients(device, name, reduction, dims, keepdim):
    input = heavy_tailed(SHAPE, device=device).requires_grad_()
    target = heavy_tailed(SHAPE, device=device).requires_grad_()
    out = _call(name, input, target, reduction=reduction, dim=dims, keepdim=keepdim)
    x64, y64 = (t.detach().double().requires_grad_() for t in (input, target))
    expected = _expected(name, x64, y64, reduction, tuple(dims) if isinstance(dims, list) else dims, keepdim)
    assert out.shape == expected.shape and out.dtype == torch.float32
    _close(out, expected.detach())
    grad_output = torch.rand_like(expected) + 0.5
    got = torch.autograd.grad(out, (input, target), grad_output.float())
    want = torch.autograd.grad(expected, (x64, y64), grad_output)
    for g, w in zip(got, want):  # a per-sample weight's gradient cancels to 0: absolute error then
        _close(g, w, bound=max(w.abs().max().item(), 1.0))


@pytest.mark.parametrize("weight_shape", [(3, 1, 1, 1), (1, 4, 1, 6), (6,), SHAPE])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_per_sample_with_weight_and_scale(device, name, reduction, weight_shape):
    """A weighted mean over dim divides by the weight summed over dim as if expanded
    (Huber's by the count); a scale tensor multiplies the result and gets its gradient."""
    input, target = heavy_tailed(SHAPE, device=device).requires_grad_(), heavy_tailed(SHAPE, device=device)
    weight = (torch.rand(weight_shape, device=device) + 0.25).requires_grad_()
    scale = torch.tensor(0.37, device=device, requires_grad=True)
    dims = (1, 2, 3)
    out = _call(name, input, target, reduction=reduction, weight=weight, scale=scale, dim=dims)
    x64, w64, s64 = (t.detach().double().requires_grad_() for t in (input, weight, scale))
    expected = _expected(name, x64, target.double(), reduction, dims, weight=w64) * s64
    _close(out, expected.detach())
    got = torch.autograd.grad(out.sum(), (input, weight, scale))
    want = torch.autograd.grad(expected.sum(), (x64, w64, s64))
    # a weighted mean's weight gradient sums terms of the loss's size that cancel (a
    # per-sample weight's to 0): its error is theirs
    magnitude = max(expected.abs().max().item(), 1.0)
    for g, w in zip(got, want):
        _close(g, w, bound=max(w.abs().max().item(), magnitude))


@pytest.mark.parametrize("name", LOSSES)
def test_a_mask_over_dim_is_a_masked_per_sample_mean(device, name):
    """A bool mask keeps the loss's dtype; each sample's mean is over its own kept elements."""
    input, target = heavy_tailed(SHAPE, device=device), heavy_tailed(SHAPE, device=device)
    mask = torch.rand(SHAPE, device=device) < 0.5
    mask[:, 0, 0, 0] = True
    out = _call(name, input, target, weight=mask, dim=(1, 2, 3))
    per_element = float64_reference(name, input, target, "none", PARAMS[name])
    if losses.LOSSES[name].weighted_mean_over_count:
        expected = (per_element * mask).sum((1, 2, 3)) / mask[0].numel()
    else:
        expected = torch.stack([per_element[i][mask[i]].mean() for i in range(SHAPE[0])])
    assert out.dtype == torch.float32
    _close(out, expected)


@pytest.mark.parametrize("name", LOSSES)
def test_dim_over_everything_is_the_plain_reduction(device, name):
    input, target = heavy_tailed(SHAPE, device=device), heavy_tailed(SHAPE, device=device)
    weight = torch.rand(1, 4, 1, 1, device=device) + 0.25
    for reduction, w in itertools.product(["mean", "sum"], [None, weight]):
        every = _call(name, input, target, reduction=reduction, weight=w, dim=(0, 1, 2, 3))
        plain = _call(name, input, target, reduction=reduction, weight=w)
        assert every.shape == plain.shape == ()
        _close(every, plain.double())


@pytest.mark.parametrize("name", LOSSES)
def test_empty_dims_and_0d_losses(device, name):
    """A mean over an empty dimension is NaN (0 / 0), a sum 0, as torch.mean and torch.sum
    give; a 0-d loss reduces over its one dimension 0."""
    input, target = heavy_tailed((2, 0, 3), device=device), heavy_tailed((2, 0, 3), device=device)
    assert _call(name, input, target, dim=1).isnan().all()
    assert (_call(name, input, target, reduction="sum", dim=1) == 0).all()
    assert _call(name, input, target, dim=(0, 2)).shape == (0,)
    x, y = torch.tensor(1.5, device=device), torch.tensor(-0.5, device=device)
    assert _call(name, x, y, dim=0).shape == () and _call(name, x, y, dim=-1, keepdim=True).shape == ()
    _close(_call(name, x, y, dim=0), float64_reference(name, x, y, "mean", PARAMS[name]))


@pytest.mark.parametrize("name", LOSSES)
def test_dim_errors(name):
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        _call(name, x, x, reduction="none", dim=0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        _call(name, x, x, dim=2)
    with pytest.raises(RuntimeError, match="appears multiple times"):
        _call(name, x, x, dim=(1, -1))
    with pytest.raises(ValueError, match="names no dimension"):
        _call(name, x, x, dim=())
    with pytest.raises(TypeError, match="dim must be an int"):
        _call(name, x, x, dim=(0.5,))
    with pytest.raises(ValueError, match="does not broadcast"):
        _call(name, x, x, dim=0, weight=torch.ones(4))


def test_legacy_arguments_choose_the_reduction():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(fusedloss.mse_loss(x, y, size_average=False, dim=1),
                               fusedloss.mse_loss(x, y, reduction="sum", dim=1))


@pytest.mark.parametrize("name", LOSSES)
def test_modules_take_dim(name):
    row = losses.LOSSES[name]
    module = getattr(fusedloss.nn, row.module)(reduction="sum")
    x, y = heavy_tailed(SHAPE), heavy_tailed(SHAPE)
    if row.param is not None:
        setattr(module, row.param, PARAMS[name])
    torch.testing.assert_close(module(x, y, dim=(2, 3), keepdim=True),
                               _call(name, x, y, reduction="sum", dim=(2, 3), keepdim=True))


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_bf16_per_sample_mean(name):
    """The min-SNR shape: bf16 per-sample means, computed with float32 sums."""
    x = heavy_tailed((8, 4, 16, 16), device="cuda").clamp(-8, 8).bfloat16()
    y = heavy_tailed((8, 4, 16, 16), device="cuda").clamp(-8, 8).bfloat16()
    out = _call(name, x, y, dim=(1, 2, 3))
    assert out.dtype == torch.bfloat16 and out.shape == (8,)
    _close(out, _expected(name, x, y, "mean", (1, 2, 3)), torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_per_sample_pass(monkeypatch, name, reduction, dtype):
    """dim= over the trailing dimensions of a batch: the per-sample operator's one pass over
    rows of several tiles each, against float64, with the same bits on every run; the
    gradients of both operands for a grad_output of several magnitudes."""
    from fusedloss import routing

    calls = []
    fused = routing.fused_per_sample_loss
    monkeypatch.setattr(routing, "fused_per_sample_loss", lambda *args: calls.append(args) or fused(*args))
    shape = (5, 3, 40, 72)
    bound = 8 if dtype in (torch.float16, torch.bfloat16) else 1e3  # a 16-bit loss per sample stays finite
    x = heavy_tailed(shape, device="cuda").clamp(-bound, bound).to(dtype).requires_grad_()
    y = heavy_tailed(shape, device="cuda").clamp(-bound, bound).to(dtype).requires_grad_()
    out = _call(name, x, y, reduction=reduction, dim=(1, 2, 3))
    assert len(calls) == 1 and out.shape == (5,) and out.dtype == dtype
    assert torch.equal(out, _call(name, x, y, reduction=reduction, dim=(1, 2, 3)))
    x64, y64 = (t.detach().double().requires_grad_() for t in (x, y))
    expected = _expected(name, x64, y64, reduction, (1, 2, 3))
    _close(out, expected.detach(), dtype, bound=expected.abs().max().item())
    scales = [100.0, 2.0**8] if dtype == torch.float16 else [1000.0, 2.0**16]  # loss scales float16 can hold
    grad_output = torch.tensor([1.0, 0.37, *scales, -3.0], device="cuda").to(dtype)
    got = torch.autograd.grad(out, (x, y), grad_output)
    want = torch.autograd.grad(expected, (x64, y64), grad_output.double())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        _close(g, w, dtype, bound=w.abs().max().item())


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_per_sample_pass_under_autocast_and_in_a_graph(monkeypatch, name):
    """Under bf16 autocast the per-sample pass computes in float32 and returns float32, as
    autocast's loss per element does; captured in a CUDA graph, a replay gives eager's bits."""
    from fusedloss import routing

    calls = []
    fused = routing.fused_per_sample_loss
    monkeypatch.setattr(routing, "fused_per_sample_loss", lambda *args: calls.append(args) or fused(*args))
    x = heavy_tailed((4, 3, 16, 16), device="cuda").clamp(-8, 8).bfloat16().requires_grad_()
    y = heavy_tailed((4, 3, 16, 16), device="cuda").clamp(-8, 8).bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = _call(name, x, y, dim=(1, 2, 3))
    assert len(calls) == 1 and out.dtype == torch.float32
    expected = _expected(name, x.detach().double(), y.double(), "mean", (1, 2, 3))
    _close(out, expected, bound=expected.abs().max().item())
    grad, = torch.autograd.grad(out, x, torch.rand_like(out) * 1000)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()
    inputs = x.detach()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _call(name, inputs, y, dim=(1, 2, 3))  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _call(name, inputs, y, dim=(1, 2, 3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _call(name, inputs, y, dim=(1, 2, 3)))
