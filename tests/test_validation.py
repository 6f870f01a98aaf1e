"""Shapes and dtypes without data (meta and fake tensors), subclasses, integer inputs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import LOSSES, loss_kwargs

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("device", ["meta", "fake-cpu", "fake-cuda"])
def test_shapes_and_dtypes_without_data(name, reduction, device):
    """Meta and CPU tensors go to torch.nn.functional (so they match it exactly); fake CUDA
    tensors reach fusedloss's fake kernels, which must match what real tensors give.
    (PyTorch's own meta kernel for huber_loss returns the promoted dtype where its
    real kernels return the input's.)"""
    ours, theirs, _ = LOSSES[name]
    kwargs = {"reduction": reduction, **loss_kwargs(name, 0.5)}
    for a in DTYPES:
        for b in DTYPES:
            real = theirs(torch.ones(4, 1, 3, dtype=a), torch.ones(5, 1, dtype=b), **kwargs)
            if device == "meta":
                x, y = torch.empty(4, 1, 3, dtype=a, device="meta"), torch.empty(5, 1, dtype=b, device="meta")
                out, expected = ours(x, y, **kwargs), theirs(x, y, **kwargs)
                assert (out.shape, out.dtype, out.device) == (expected.shape, expected.dtype, expected.device)
                continue
            with FakeTensorMode():
                kind = device.removeprefix("fake-")
                x, y = torch.empty(4, 1, 3, dtype=a, device=kind), torch.empty(5, 1, dtype=b, device=kind)
                out = ours(x, y, **kwargs)
                if kind == "cpu":  # handed to torch.nn.functional, like meta tensors
                    real = theirs(x, y, **kwargs)
            assert (out.shape, out.dtype, out.device.type) == (real.shape, real.dtype, kind)


def test_requires_grad_on_integer_inputs_errors_like_torch():
    with pytest.raises(RuntimeError, match="floating point"):
        torch.ones(3, dtype=torch.int64).requires_grad_()


@pytest.mark.parametrize("name", LOSSES)
def test_float_input_with_integer_target_behaves_like_torch(name):
    ours, theirs, _ = LOSSES[name]
    x = torch.randn(4, requires_grad=True)
    y = torch.arange(4)
    try:
        expected = theirs(x, y)
    except Exception as error:
        with pytest.raises(type(error)):
            ours(x, y)
    else:
        torch.testing.assert_close(ours(x, y), expected)
