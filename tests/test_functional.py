"""fusedloss.* against torch.nn.functional: values, dtypes, shapes, warnings, errors.

Every test runs on the CPU, where fusedloss hands tensors to torch.nn.functional,
and through the fused path on the CPU (the ops' reference kernels, fixture
`fused_cpu`), which runs the same argument handling the CUDA path does. With a
GPU the same tests run on CUDA against PyTorch's CUDA results.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from fusedloss import losses, routing

from conftest import DTYPE_PAIRS, LOSSES, TOLERANCE, TORCH_LOSSES, heavy_tailed, loss_kwargs, requires_cuda

REDUCTIONS = ("none", "mean", "sum")
WITH_PARAM = [name for name, row in losses.LOSSES.items() if row.param]
WITH_ZERO_PARAM = [name for name, row in losses.LOSSES.items() if row.param_zero_is]
# PyTorch's losses that take its legacy size_average and reduce, and those that take a weight
LEGACY = [name for name in TORCH_LOSSES if "reduce" in inspect.signature(LOSSES[name][1]).parameters]
TORCH_WEIGHTED = [name for name in TORCH_LOSSES if "weight" in inspect.signature(LOSSES[name][1]).parameters]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 33), (4, 1, 17)]


def _call_both(name, input, target, **kwargs):
    ours, theirs, _ = LOSSES[name]
    with warnings.catch_warnings(record=True) as our_warnings:
        warnings.simplefilter("always")
        out = ours(input, target, **kwargs)
    with warnings.catch_warnings(record=True) as their_warnings:
        warnings.simplefilter("always")
        expected = theirs(input, target, **kwargs)
    return out, expected, our_warnings, their_warnings


def _assert_matches(out, expected):
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape
    assert out.device == expected.device
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("name", TORCH_LOSSES)
def test_signature_matches_torch(name):
    """PyTorch's parameters in PyTorch's order, with its defaults; fusedloss's own are keyword-only,
    with defaults that leave the call PyTorch's."""
    ours, theirs, _ = LOSSES[name]
    our_parameters = list(inspect.signature(ours).parameters.values())
    their_parameters = list(inspect.signature(theirs).parameters.values())
    assert [p.name for p in our_parameters[: len(their_parameters)]] == [p.name for p in their_parameters]
    for ours_p, theirs_p in zip(our_parameters, their_parameters):
        assert (ours_p.default, ours_p.kind) == (theirs_p.default, theirs_p.kind)
    for extra in our_parameters[len(their_parameters):]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default in (None, False)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_torch_float32(device, name, reduction, shape):
    input = heavy_tailed(shape, device=device)
    target = heavy_tailed(shape, device=device)
    out, expected, _, _ = _call_both(name, input, target, reduction=reduction)
    _assert_matches(out, expected)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_dtype_pairs(device, name, reduction, dtypes):
    input = (torch.randn(6, 9, device=device) * 2).to(dtypes[0])
    target = torch.randn(6, 9, device=device).to(dtypes[1])
    out, expected, _, _ = _call_both(name, input, target, reduction=reduction)
    _assert_matches(out, expected)


@pytest.mark.parametrize("name", WITH_PARAM)
@pytest.mark.parametrize("param", [1e-30, 0.25, 1.0, 3.0, 1e30])
def test_params(device, name, param):
    """Across the param's domain (a quantile's is [0, 1]: the rest raise a ValueError)."""
    input, target = heavy_tailed((50,), device=device), heavy_tailed((50,), device=device)
    if not losses.LOSSES[name].param_valid(param):
        assert _error_of(LOSSES[name][0], input, target, **loss_kwargs(name, param))[0] is ValueError
        return
    for reduction in REDUCTIONS:
        out, expected, _, _ = _call_both(name, input, target, reduction=reduction, **loss_kwargs(name, param))
        _assert_matches(out, expected)


@pytest.mark.parametrize("name", WITH_ZERO_PARAM)
def test_a_zero_param_is_another_loss(device, name):
    """Smooth L1 with beta = 0 is L1, as PyTorch has it."""
    input, target = heavy_tailed((40,), device=device), heavy_tailed((40,), device=device)
    out = LOSSES[name][0](input, target, **loss_kwargs(name, 0.0))
    _assert_matches(out, LOSSES[losses.LOSSES[name].param_zero_is][1](input, target))


@pytest.mark.parametrize("name", LOSSES)
def test_broadcast_warns_like_torch(device, name):
    """PyTorch's warning, once; none for a loss whose target broadcasts by design (quantiles)."""
    input, target = torch.randn(3, 4, device=device), torch.randn(4, device=device)
    out, expected, ours, theirs = _call_both(name, input, target, reduction="none")
    _assert_matches(out, expected)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert len(ours) == losses.LOSSES[name].warns_on_broadcast
    if ours and routing.kernels_apply(input, target):
        # The fused path points the warning at the caller, as PyTorch does. (Handed to
        # torch.nn.functional, the warning points at fusedloss/functional.py.)
        assert ours[0].filename == __file__


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize(
    "legacy", [dict(size_average=False), dict(reduce=False), dict(size_average=True, reduce=True)], ids=str
)
def test_legacy_reduction_arguments(device, name, legacy):
    input, target = torch.randn(5, 3, device=device), torch.randn(5, 3, device=device)
    out, expected, ours, theirs = _call_both(name, input, target, **legacy)
    _assert_matches(out, expected)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]


@pytest.mark.parametrize("name", LOSSES)
def test_empty_input(device, name):
    empty = torch.empty(0, 3, device=device)
    assert torch.isnan(LOSSES[name][0](empty, empty)).item()
    assert LOSSES[name][0](empty, empty, reduction="sum").item() == 0
    assert LOSSES[name][0](empty, empty, reduction="none").shape == (0, 3)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_and_inf_propagate(device, name, reduction):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, float("inf"), 0.0], device=device)
    other = torch.tensor([0.5, 1.0, 2.0, float("nan"), float("inf"), -float("inf")], device=device)
    out, expected, _, _ = _call_both(name, special, other, reduction=reduction)
    _assert_matches(out, expected)


def _error_of(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as info:
            fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize(
    "bad",
    [
        dict(reduction="average"),
        dict(reduction="elementwise"),
    ],
    ids=str,
)
def test_invalid_reduction_errors_like_torch(device, name, bad):
    x = torch.randn(4, device=device)
    ours, theirs, _ = LOSSES[name]
    assert _error_of(ours, x, x, **bad) == _error_of(theirs, x, x, **bad)


@pytest.mark.parametrize("name", WITH_PARAM)
@pytest.mark.parametrize("param", [0.0, -2.0, float("nan"), 1.5])
def test_invalid_param_errors_like_torch(device, name, param):
    """PyTorch's error for its losses; a ValueError for fusedloss's own."""
    if losses.LOSSES[name].param_valid(param):
        pytest.skip("in the loss's domain (0 is Smooth L1's L1, a quantile's own)")
    x = torch.randn(4, device=device)
    ours, theirs, _ = LOSSES[name]
    error = _error_of(ours, x, x, **loss_kwargs(name, param))
    if name in TORCH_LOSSES:
        assert error == _error_of(theirs, x, x, **loss_kwargs(name, param))
    else:
        assert error[0] is ValueError and losses.LOSSES[name].param in error[1]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_and_bool_inputs_error_like_torch(device, name, dtype):
    x = torch.ones(4, device=device, dtype=dtype)
    ours, theirs, _ = LOSSES[name]
    assert _error_of(ours, x, x) == _error_of(theirs, x, x)


@pytest.mark.parametrize("name", LOSSES)
def test_mismatched_shapes_error_like_torch(device, name):
    ours, theirs, _ = LOSSES[name]
    a, b = torch.randn(3, device=device), torch.randn(4, device=device)
    assert _error_of(ours, a, b) == _error_of(theirs, a, b)


@pytest.mark.parametrize("name", LOSSES)
def test_different_devices_error_like_torch(name):
    ours, theirs, _ = LOSSES[name]
    a, b = torch.randn(3), torch.randn(3, device="meta")
    assert _error_of(ours, a, b) == _error_of(theirs, a, b)


@requires_cuda
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_and_cpu_operands_behave_like_torch(name):
    ours, theirs, _ = LOSSES[name]
    a, b = torch.randn(3, device="cuda"), torch.randn(3)
    assert _error_of(ours, a, b) == _error_of(theirs, a, b)
    scalar = torch.tensor(0.5)  # a 0-d CPU tensor too: the losses broadcast it first
    assert _error_of(ours, a, scalar) == _error_of(theirs, a, scalar)


@pytest.mark.parametrize("name", TORCH_WEIGHTED)
def test_weight_goes_to_torch(device, name):
    input, target, weight = (torch.rand(5, device=device) for _ in range(3))
    out, expected, _, _ = _call_both(name, input, target, weight=weight)
    _assert_matches(out, expected)


class _Tagged(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _Tagged.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("name", LOSSES)
def test_tensor_subclasses_see_the_torch_function(name):
    ours, theirs, _ = LOSSES[name]
    _Tagged.seen = []
    x = torch.randn(4).as_subclass(_Tagged)
    ours(x, torch.randn(4))
    if name in TORCH_LOSSES:
        assert _Tagged.seen[0] is theirs
    else:  # computed with torch operations, which the subclass sees
        assert _Tagged.seen
