"""Shapes and dtypes without data (meta and fake tensors), subclasses, integer inputs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedloss

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


# ---- bad arguments: PyTorch-style errors or a documented NaN, never a plausible number ----


@pytest.mark.parametrize("scale", ["0.5", 1j, torch.tensor(1j), [0.5]], ids=["str", "complex", "complex-tensor", "list"])
def test_a_scale_that_is_not_real_raises_a_type_error(scale):
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(TypeError, match="scale must be a real number"):
        fusedloss.mse_loss(x, y, scale=scale)


@pytest.mark.parametrize("name,keyword", [("smooth_l1", "beta"), ("huber", "delta")])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_string_parameter_raises_pytorchs_type_error(name, keyword, weighted):
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    extra = {"weight": torch.ones(3)} if weighted else {}
    with pytest.raises(TypeError, match=f"argument '{keyword}'.* must be float, not str"):
        LOSSES[name][0](x, y, **{keyword: "1"}, **extra)


def test_a_string_c_raises_a_type_error():
    with pytest.raises(TypeError, match="argument 'c' must be float or Tensor, not str"):
        fusedloss.pseudo_huber_loss(torch.randn(3), torch.randn(3), c="1")


@pytest.mark.parametrize("bad", [0.0, -0.5])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_a_tensor_c_not_above_zero_gives_nan_losses(bad, reduction):
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    c = torch.tensor([[bad], [0.7]], requires_grad=True)
    out = fusedloss.pseudo_huber_loss(x, y, c=c, reduction=reduction)
    if reduction == "none":
        assert out[0].isnan().all() and not out[1].isnan().any()
        torch.testing.assert_close(out[1], fusedloss.pseudo_huber_loss(x[1], y[1], c=0.7, reduction="none"))
    else:
        assert out.isnan()
    out.sum().backward()
    if reduction == "none":  # the valid row keeps its gradient
        assert c.grad[1].isfinite().all() and c.grad[0].eq(0).all()


@pytest.mark.parametrize("a, b", [((2, 3), (2, 3)), ((4, 1, 3), (1, 5, 3)), ((0, 1), (1, 7)), ((1, 0), (3, 1)),
                                  ((4, 1, 3), (5, 1)), ((3,), ()), ((), ()), ((2, 3), (3, 2)), ((2, 3), (2, 4)),
                                  ((0,), (2,))])
def test_the_loss_shape_is_torchs_broadcast_shape(a, b):
    """reductions.loss_shape works equal ranks out itself: its shapes, and errors, are
    torch.broadcast_shapes'."""
    from fusedloss import reductions

    x, y = torch.empty(a, device="meta"), torch.empty(b, device="meta")
    try:
        expected = torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=str(error)[:40]):
            reductions.loss_shape(x, y)
        return
    shape = reductions.loss_shape(x, y)
    assert shape == expected and type(shape) is torch.Size
