"""The quantile (pinball) loss's own promises. One q is a row of the table of losses, which
every matrix covers; here: several quantiles along the last dimension, their forms
(sequence, tensor, CPU tensor for GPU operands), their checks, the gradient's ties and
NaN as autograd gives them for torch.maximum, and the forecasting libraries' reductions."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TOLERANCE, heavy_tailed, requires_cuda

import fusedloss
from fusedloss import functional

QUANTILES = [0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98]


def pinball64(input, target, q):
    """The forecasting libraries' formula, max((q - 1) e, q e) of e = target - input, in float64."""
    e = target.double() - input.double()
    q = torch.as_tensor(q, dtype=torch.float64, device=e.device)
    return torch.maximum((q - 1) * e, q * e)


def _close(actual, expected64, dtype=torch.float32):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=rtol * 4, atol=atol * 4, equal_nan=True)


@pytest.mark.parametrize("form", ["list", "tuple", "tensor", "float64-tensor"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_forecast_shape(device, reduction, form):
    """(batch, horizon, Q) predictions against a (batch, horizon, 1) target, read where it lies."""
    q = {"list": QUANTILES, "tuple": tuple(QUANTILES), "tensor": torch.tensor(QUANTILES, device=device),
         "float64-tensor": torch.tensor(QUANTILES, dtype=torch.float64, device=device)}[form]
    input = heavy_tailed((16, 24, len(QUANTILES)), device=device).requires_grad_()
    target = heavy_tailed((16, 24, 1), device=device).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the target broadcasts along the quantiles by design: no warning
        out = fusedloss.quantile_loss(input, target, q, reduction=reduction)
    x64, t64 = (t.detach().double().requires_grad_() for t in (input, target))
    per_element = pinball64(x64, t64, QUANTILES)
    expected = {"none": per_element, "mean": per_element.mean(), "sum": per_element.sum()}[reduction]
    assert out.dtype == torch.float32 and out.shape == expected.shape
    _close(out, expected.detach())
    grad_output = torch.rand_like(expected) + 0.5
    got = torch.autograd.grad(out, (input, target), grad_output.float())
    want = torch.autograd.grad(expected, (x64, t64), grad_output)
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_forecast_shape_in_other_dtypes(device, dtype):
    if device == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float64  # the formula's CPU 16-bit math is PyTorch's; the kernels' are checked on CUDA
    input = heavy_tailed((8, 12, 3), device=device).clamp(-8, 8).to(dtype)
    target = heavy_tailed((8, 12, 1), device=device).clamp(-8, 8).to(dtype)
    out = fusedloss.quantile_loss(input, target, [0.1, 0.5, 0.9], reduction="none")
    assert out.dtype == dtype
    _close(out, pinball64(input, target, [0.1, 0.5, 0.9]), dtype)


def test_weight_scale_and_dim_compose_with_several_quantiles(device):
    """The forecasting recipes: a padding mask over (batch, horizon), a mean per series."""
    input, target = heavy_tailed((6, 10, 3), device=device), heavy_tailed((6, 10, 1), device=device)
    mask = torch.rand(6, 10, 1, device=device) < 0.7
    mask[:, 0] = True
    q = [0.1, 0.5, 0.9]
    per_element = pinball64(input, target, q)
    masked = fusedloss.quantile_loss(input, target, q, weight=mask)
    _close(masked, (per_element * mask).sum() / (mask.sum() * 3))
    per_series = fusedloss.quantile_loss(input, target, q, weight=mask, dim=(1, 2), scale=2.0)
    _close(per_series, 2 * (per_element * mask).sum((1, 2)) / (mask.sum((1, 2)) * 3))


def test_the_forecasting_libraries_reductions(device):
    """The mappings the README gives: pytorch-forecasting's QuantileLoss doubles the pinball
    loss (the MAE at q = 0.5) and averages over every element; neuralforecast's MQLoss
    divides each by Q and averages; summing over the quantiles and averaging the rest is Q
    times the mean."""
    input, target = heavy_tailed((4, 7, 3), device=device), heavy_tailed((4, 7), device=device)
    q = [0.1, 0.5, 0.9]
    pytorch_forecasting = torch.cat([torch.max((qi - 1) * (target - input[..., i]), qi * (target - input[..., i]))
                                     .unsqueeze(-1) for i, qi in enumerate(q)], dim=-1) * 2
    ours = fusedloss.quantile_loss(input, target[..., None], q)
    _close(2 * ours, pytorch_forecasting.mean().double())
    error = input - target[..., None]
    qt = torch.tensor(q, device=device)
    neuralforecast = (1 / len(q)) * (qt * torch.relu(-error) + (1 - qt) * torch.relu(error))
    _close(ours / len(q), neuralforecast.mean().double())
    _close(len(q) * ours, pinball64(input, target[..., None], q).sum(-1).mean())


def test_ties_and_nan_differentiate_as_torch_maximum(device):
    """At p == t the gradient is 1/2 - q; where a branch is NaN (0 * inf at q = 0 or 1)
    both slopes; values NaN as torch.maximum gives them."""
    for q in (0.0, 0.3, 1.0):
        input = torch.tensor([0.5, 1.0, float("nan"), float("inf"), -float("inf"), 2.0], device=device)
        target = torch.tensor([0.5, float("inf"), 1.0, 1.0, 1.0, -float("inf")], device=device)
        x, t = input.clone().requires_grad_(), target.clone().requires_grad_()
        out = fusedloss.quantile_loss(x, t, q, reduction="none")
        x64, t64 = input.double().requires_grad_(), target.double().requires_grad_()
        e = t64 - x64
        expected = torch.maximum((q - 1) * e, q * e)
        assert torch.equal(out.isnan(), expected.isnan()), (q, out, expected)
        _close(out, expected.detach())
        got = torch.autograd.grad(out.sum(), (x, t))
        want = torch.autograd.grad(expected.sum(), (x64, t64))
        for g, w in zip(got, want):
            _close(g, w)


def test_checks():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"quantiles in \[0, 1\]"):
        fusedloss.quantile_loss(x, x, [0.1, 1.5, 0.5])
    with pytest.raises(ValueError, match=r"quantiles in \[0, 1\]"):
        fusedloss.quantile_loss(x, x, -0.25)
    with pytest.raises(ValueError, match="2 quantiles for a loss whose last dimension is 3"):
        fusedloss.quantile_loss(x, x, [0.1, 0.9])
    with pytest.raises(ValueError, match="do not broadcast"):
        fusedloss.quantile_loss(x, x, torch.tensor([0.1, 0.9]))
    with pytest.raises(ValueError, match="empty"):
        fusedloss.quantile_loss(x, x, [])
    with pytest.raises(TypeError, match="quantiles must be"):
        fusedloss.quantile_loss(x, x, "0.5")
    with pytest.raises(TypeError, match="quantiles must be"):
        fusedloss.quantile_loss(x, x, True)


def test_a_tensors_quantiles_outside_0_1_give_nan(device):
    """Checking a tensor on the host would wait for the GPU: its bad entries give NaN."""
    x, t = heavy_tailed((5, 3), device=device), heavy_tailed((5, 1), device=device)
    out = fusedloss.quantile_loss(x, t, torch.tensor([0.2, 1.5, float("nan")], device=device), reduction="none")
    assert out[:, 0].isfinite().all() and out[:, 1:].isnan().all()
    assert fusedloss.quantile_loss(x, t, torch.tensor([0.2, -0.1, 0.5], device=device)).isnan()


def test_one_quantile_in_any_form_is_the_fused_number(device):
    x, t = heavy_tailed((5, 4), device=device), heavy_tailed((5, 4), device=device)
    one = fusedloss.quantile_loss(x, t, 0.3)
    for form in ([0.3], (0.3,), torch.tensor([0.3]), torch.tensor(0.3)):
        torch.testing.assert_close(fusedloss.quantile_loss(x, t, form), one)


@pytest.mark.parametrize("place", ["meta", "cpu"])
def test_a_default_device_places_nothing_of_the_loss(device, place):
    """Under ``with torch.device(...)`` (torch.set_default_device) the quantiles of a sequence
    are still made on the host and moved to the operands' device: the same loss and gradient."""
    input = heavy_tailed((16, 24, len(QUANTILES)), device=device).requires_grad_()
    target = heavy_tailed((16, 24, 1), device=device)
    results = []
    for context in (torch.device(place), torch.device(device)):
        with context:
            out = fusedloss.quantile_loss(input, target, QUANTILES)
            grad, = torch.autograd.grad(out, input)
        results.append((out, grad))
    (out, grad), (expected, expected_grad) = results
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    _close(out, pinball64(input, target, QUANTILES).mean())


def test_a_sequence_is_kept_on_the_device_once():
    """The same quantiles give the same device tensor: a step copies nothing to the GPU."""
    x = torch.randn(2, 3)
    first = functional._as_quantiles([0.1, 0.5, 0.9], x, x)
    assert functional._as_quantiles([0.1, 0.5, 0.9], x, x) is first
    assert functional._as_quantiles([0.1, 0.5, 0.9], x.double(), x).dtype == torch.float64


def test_module():
    module = fusedloss.nn.QuantileLoss([0.1, 0.5, 0.9], reduction="sum")
    assert module.quantiles == [0.1, 0.5, 0.9] and module.reduction == "sum"
    assert fusedloss.nn.QuantileLoss().quantiles == 0.5
    x, t = torch.randn(4, 3), torch.randn(4, 1)
    torch.testing.assert_close(module(x, t), fusedloss.quantile_loss(x, t, [0.1, 0.5, 0.9], reduction="sum"))


@requires_cuda
def test_cuda_quantiles_from_the_host_cost_no_sync():
    x, t = torch.randn(64, 24, 3, device="cuda"), torch.randn(64, 24, 1, device="cuda")
    fusedloss.quantile_loss(x, t, [0.1, 0.5, 0.9])  # the first call keeps them on the device
    on_device = torch.tensor([0.1, 0.5, 0.9], device="cuda")  # its own copy waits: made before the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        for form in ([0.1, 0.5, 0.9], on_device, 0.25):
            fusedloss.quantile_loss(x, t, form)
    finally:
        torch.cuda.set_sync_debug_mode("default")
