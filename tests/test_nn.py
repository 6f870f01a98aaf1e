"""fusedloss.nn modules against their torch.nn parents."""

from __future__ import annotations

import pickle

import pytest
import torch

import fusedloss.nn

from conftest import heavy_tailed, requires_cuda

PAIRS = [
    (fusedloss.nn.MSELoss, torch.nn.MSELoss, {}),
    (fusedloss.nn.L1Loss, torch.nn.L1Loss, {}),
    (fusedloss.nn.SmoothL1Loss, torch.nn.SmoothL1Loss, {"beta": 0.5}),
    (fusedloss.nn.HuberLoss, torch.nn.HuberLoss, {"delta": 2.0}),
]


@pytest.mark.parametrize("ours,theirs,kwargs", PAIRS, ids=lambda p: getattr(p, "__name__", ""))
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_module_matches_torch(ours, theirs, kwargs, reduction, device):
    module, reference = ours(reduction=reduction, **kwargs), theirs(reduction=reduction, **kwargs)
    assert isinstance(module, theirs)
    assert repr(module) == repr(reference)
    input = heavy_tailed((5, 11), device=device).requires_grad_()
    target = heavy_tailed((5, 11), device=device)
    out, expected = module(input, target), reference(input, target)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.autograd.grad(out.sum(), input)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), input)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ours,theirs,kwargs", PAIRS, ids=lambda p: getattr(p, "__name__", ""))
def test_module_state_and_pickling(ours, theirs, kwargs):
    module = ours(**kwargs)
    assert module.state_dict() == theirs(**kwargs).state_dict()
    clone = pickle.loads(pickle.dumps(module))
    assert type(clone) is ours and clone.reduction == module.reduction


def test_legacy_module_arguments():
    with pytest.warns(UserWarning):
        module = fusedloss.nn.MSELoss(size_average=False)
    assert module.reduction == "sum"
