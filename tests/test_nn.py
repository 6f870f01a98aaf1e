"""fusedloss.nn modules, one per row of the table of losses: against their torch.nn
parents where PyTorch has the loss, against the functional form otherwise."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch

import fusedloss
import fusedloss.nn
from fusedloss import losses

from conftest import LOSSES, PARAMS, TORCH_LOSSES, heavy_tailed, loss_kwargs, requires_cuda


def _modules(name: str, reduction: str = "mean"):
    """(fusedloss's module, a module or function that computes the expected loss)."""
    row = losses.LOSSES[name]
    kwargs = loss_kwargs(name, PARAMS[name])
    ours = getattr(fusedloss.nn, row.module)(reduction=reduction, **kwargs)
    if row.pytorch:
        return ours, getattr(torch.nn, row.module)(reduction=reduction, **kwargs)
    return ours, lambda input, target: LOSSES[name][1](input, target, reduction=reduction, **kwargs)


def test_every_row_has_a_module():
    """One per row of the table of losses, and the likelihoods' (tests/test_likelihood.py)."""
    expected = [row.module for row in losses.LOSSES.values()] + ["GaussianNLLLoss", "PoissonNLLLoss"]
    assert sorted(fusedloss.nn.__all__) == sorted(expected)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_module_matches_torch(name, reduction, device):
    module, reference = _modules(name, reduction)
    if name in TORCH_LOSSES:
        assert isinstance(module, type(reference))
        assert repr(module) == repr(reference)
    input = heavy_tailed((5, 11), device=device).requires_grad_()
    target = heavy_tailed((5, 11), device=device)
    out, expected = module(input, target), reference(input, target)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.autograd.grad(out.sum(), input)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), input)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", LOSSES)
def test_module_takes_weight_and_scale(name):
    module, _ = _modules(name, "sum")
    input, target, weight = heavy_tailed((4, 3)), heavy_tailed((4, 3)), torch.rand(4, 1)
    function = LOSSES[name][0]
    expected = function(input, target, reduction="sum", weight=weight, scale=0.5,
                        **loss_kwargs(name, PARAMS[name]))
    torch.testing.assert_close(module(input, target, weight, scale=0.5), expected)


@pytest.mark.parametrize("name", LOSSES)
def test_module_state_and_pickling(name):
    module, reference = _modules(name)
    if name in TORCH_LOSSES:
        assert module.state_dict() == reference.state_dict()
    clone = pickle.loads(pickle.dumps(module))
    assert type(clone) is type(module) and clone.reduction == module.reduction
    row = losses.LOSSES[name]
    if row.param:
        assert getattr(clone, row.param) == PARAMS[name]


@pytest.mark.parametrize("name", [name for name in LOSSES if name not in TORCH_LOSSES])
def test_own_module_signature_and_repr(name):
    """fusedloss's own losses: (param=default, reduction='mean'), the param in the repr."""
    row = losses.LOSSES[name]
    module_class = getattr(fusedloss.nn, row.module)
    expected = ([row.param] if row.param else []) + ["reduction"]
    assert list(inspect.signature(module_class).parameters) == expected
    module = module_class()
    assert module.reduction == "mean"
    if row.param:
        assert getattr(module, row.param) == row.param_default
        assert repr(module) == f"{row.module}({row.param}={row.param_default})"
        assert getattr(module_class(0.5), row.param) == 0.5
    with pytest.raises(TypeError):
        module_class(reduction="sum", unknown=1)


def test_legacy_module_arguments():
    with pytest.warns(UserWarning):
        module = fusedloss.nn.MSELoss(size_average=False)
    assert module.reduction == "sum"
