"""The fusedloss:: operators: schemas, fake kernels, opcheck and autograd.

On the CPU these run against the ops' reference kernels; with a GPU the same
checks run against the CUDA kernels.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedloss
from fusedloss import build, formulas, losses, routing
from fusedloss import ops  # noqa: F401

from conftest import (FLOAT_DTYPES, LOSSES, PARAMS, PYTORCH_SERVES_THE_STEP, TOLERANCE, heavy_tailed, loss_kwargs,
                      requires_cuda)

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(autouse=True)
def kernels_loaded(request):
    if torch.cuda.is_available():
        build.load()


def test_schemas():
    for name in ("grad_output_history", "weighted_grad_output_history", "loss_gradients", *build.OPS):
        assert hasattr(torch.ops.fusedloss, name)
    schema = torch.ops.fusedloss.reduced_loss.default._schema
    assert [a.name for a in schema.arguments] == ["input", "target", "loss", "param", "reduction", "output_mask",
                                                  "expected_grad_output", "autocast"]
    # The history slot is the backward's (the Function's, not the forward operator's).
    schema = torch.ops.fusedloss.weighted_loss.default._schema
    assert "history_slot" not in [a.name for a in schema.arguments]
    schema = torch.ops.fusedloss.reduced_loss_backward.default._schema
    assert [a.name for a in schema.arguments] == ["grad_output", "input", "target", "loss", "param", "reduction",
                                                  "output_mask", "history_slot", "expected_grad_output", "autocast"]
    for name, written in (("reduced_loss_backward_", 2), ("weighted_loss_backward_", 3)):
        arguments = getattr(torch.ops.fusedloss, name).default._schema.arguments
        assert [bool(a.alias_info and a.alias_info.is_write) for a in arguments[:written + 1]] == [True] * written + [False]


def test_the_history_slot_reaches_the_backward_not_the_forward():
    """The Functions take the operator's tensors, then the other arguments in a tuple with the
    backward's history slot after output_mask, and hand the forward operator the others;
    through the operator the backward notes nowhere."""
    input, target = torch.randn(5, 7, requires_grad=True), torch.randn(5, 7)
    weight = torch.rand(5, 1)
    assert ops.ReducedLoss.history_slot_at == 6 and ops.WeightedLoss.history_slot_at == 9
    assert ops.PointwiseLoss.history_slot_at is None
    assert [f.tensor_arguments for f in (ops.PointwiseLoss, ops.ReducedLoss, ops.WeightedLoss, ops.PerSampleLoss)] == [
        2, 2, 5, 2]
    out = ops.ReducedLoss.apply(input, target, ("huber", 1.5, "mean", [True, False], 7, 0.5, False))
    assert out[0].grad_fn.slot == 7 and out[0].grad_fn.expected_grad_output == 0.5
    (grad,) = torch.autograd.grad(out[0], input)
    torch.testing.assert_close(grad, torch.autograd.grad(torch.nn.functional.huber_loss(input, target, delta=1.5),
                                                         input)[0])
    out = ops.call_function(ops.WeightedLoss, input, target, weight, None, None, 0.5, "mse", 0.0,
                            [True, False, False], 3, 2.0, False, -1, False)
    assert out[0].grad_fn.slot == 3 and out[0].grad_fn.expected_grad_output == 2.0
    out = torch.ops.fusedloss.reduced_loss(input, target, "mse", 0.0, "sum", [True, False], 0.5)
    assert out[0].grad_fn.slot == -1 and out[0].grad_fn.expected_grad_output == 0.5
    out = torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 0.5, "mse", 0.0, [True, False, False])
    assert out[0].grad_fn.slot == -1
    with torch.no_grad():  # routing.apply hands the operator no slot
        out = routing.apply(ops.ReducedLoss, torch.ops.fusedloss.reduced_loss.default, (input, target), input,
                            target, "mse", 0.0, "sum", [False, False], -1, 1.0, False)
    assert out[0] == torch.nn.functional.mse_loss(input, target, reduction="sum")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16), (torch.float32, torch.float64)], ids=str)
def test_fake_kernels_give_shapes_and_dtypes(device, loss, dtypes):
    with FakeTensorMode():
        input = torch.empty(4, 1, 5, dtype=dtypes[0], device=device)
        target = torch.empty(3, 1, dtype=dtypes[1], device=device)
        expected_dtype = formulas.loss_dtype(*dtypes, loss)
        out = torch.ops.fusedloss.pointwise_loss(input, target, loss, 1.0)
        assert out.shape == (4, 3, 5) and out.dtype == expected_dtype and out.device.type == device
        value, grad_input, grad_target = torch.ops.fusedloss.reduced_loss(input, target, loss, 1.0, "mean",
                                                                          [True, False])
        assert value.shape == () and value.dtype == expected_dtype
        assert grad_input.shape == (4, 3, 5) and grad_input.dtype == dtypes[0]
        assert grad_target.numel() == 0
        grads = torch.ops.fusedloss.pointwise_loss_backward(out, input, target, loss, 1.0, [False, True])
        assert grads[0].numel() == 0 and grads[1].shape == (4, 3, 5) and grads[1].dtype == dtypes[1]
        grads = torch.ops.fusedloss.reduced_loss_backward(value, input, target, loss, 1.0, "sum", [True, False], -1)
        assert grads[0].shape == (4, 3, 5) and grads[0].dtype == dtypes[0] and grads[1].numel() == 0


def _sample_args(device, loss, dtype=torch.float32, shape=(5, 7)):
    input = heavy_tailed(shape, dtype, device).requires_grad_()
    target = heavy_tailed(shape, dtype, device).requires_grad_()
    return input, target, loss, PARAMS[loss]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
def test_opcheck(device, loss):
    input, target, name, param = _sample_args(device, loss)
    broadcast_target = target.detach()[0].requires_grad_()
    for args in [(input, target, name, param), (input, broadcast_target, name, param)]:
        torch.library.opcheck(torch.ops.fusedloss.pointwise_loss, args)
        for reduction in ("mean", "sum"):
            for mask in ([True, True], [True, False], [False, False]):
                torch.library.opcheck(torch.ops.fusedloss.reduced_loss, (*args, reduction, mask))
                # Without autograd: backward corrects the returned gradients in place for its grad_output.
                torch.library.opcheck(torch.ops.fusedloss.reduced_loss,
                                      (input.detach(), args[1].detach(), name, param, reduction, mask, 0.37))
        grad_output = torch.randn(input.shape, device=device)
        torch.library.opcheck(torch.ops.fusedloss.pointwise_loss_backward,
                              (grad_output, input.detach(), args[1].detach(), name, param, [True, True]))
        for reduction in ("mean", "sum"):
            for mask in ([True, True], [False, True]):
                torch.library.opcheck(torch.ops.fusedloss.reduced_loss_backward,
                                      (torch.tensor(0.37, device=device), input.detach(), args[1].detach(), name,
                                       param, reduction, mask, -1))
        for expected in (0.37, 2.0):  # as predicted, and not
            with torch.no_grad():
                _, grad_input, grad_target = torch.ops.fusedloss.reduced_loss(*args, "mean", [True, True], 0.37)
            torch.library.opcheck(torch.ops.fusedloss.reduced_loss_backward_,
                                  (grad_input, grad_target[:0], torch.tensor(expected, device=device),
                                   input.detach(), args[1].detach(), name, param, "mean", 0.37, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("weight_shape", [None, (), (5, 1), (1, 7), (5, 7)], ids=str)
def test_opcheck_weighted(device, loss, weight_shape):
    input, target, name, param = _sample_args(device, loss)
    weight = None if weight_shape is None else torch.rand(weight_shape, device=device)
    scale, divisor = torch.tensor(0.3, device=device), torch.tensor(4.0, dtype=torch.float64, device=device)
    masks = [[True, True, False], [True, False, False], [False, False, False]]
    if weight is not None:
        masks += [[True, True, True], [False, True, True]]
    for mask in masks:
        for scales in ((None, None, 1.0), (scale, divisor, 0.5)):
            torch.library.opcheck(torch.ops.fusedloss.weighted_loss,
                                  (input, target, weight, *scales, name, param, mask))
            if weight is not None:  # the weight's and the divisor's gradients too
                weight_with_grad = weight.clone().requires_grad_()
                divisor_with_grad = scales[1] if scales[1] is None else scales[1].clone().requires_grad_()
                torch.library.opcheck(torch.ops.fusedloss.weighted_loss,
                                      (input, target, weight_with_grad, scales[0], divisor_with_grad, scales[2], name,
                                       param, mask))
    for mask in masks:
        torch.library.opcheck(torch.ops.fusedloss.weighted_loss_backward,
                              (torch.tensor(0.37, device=device), input.detach(), target.detach(), weight, scale,
                               divisor, 0.5, name, param, mask))
    mask = masks[-2] if weight is not None else masks[0]
    with torch.no_grad():
        _, *written = torch.ops.fusedloss.weighted_loss(input, target, weight, scale, divisor, 0.5, name, param, mask,
                                                        1000.0)
    torch.library.opcheck(torch.ops.fusedloss.weighted_loss_backward_,
                          (*written, torch.tensor(-3.0, device=device), input.detach(), target.detach(), weight,
                           scale, divisor, 0.5, name, param, 1000.0, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("kept, weight_shape", [(2, (2, 1, 1)), (2, (1, 3, 1)), (1, (2, 1, 1)), (0, ()), (2, None)],
                         ids=str)
def test_weighted_loss_sums_rows_for_weight_kept_dims(device, loss, kept, weight_shape):
    """weight_kept_dims: the weight's gradient output is the loss summed over each row of
    the later dimensions (float64), asked for with the operands' gradients or alone; the
    loss and the operands' gradients are those without it."""
    input, target, name, param = _sample_args(device, loss, shape=(2, 3, ops.ROW_TILING_MULTIPLE))
    weight = None if weight_shape is None else torch.rand(weight_shape, device=device)
    expected_sums = ops.loss_row_sums(input.detach(), target.detach(), name, param, kept)
    for mask in ([False, False, True], [True, False, True], [True, True, False]):
        torch.library.opcheck(torch.ops.fusedloss.weighted_loss,
                              (input, target, weight, None, None, 0.5, name, param, mask, 1.0, False, kept))
        with torch.no_grad():
            out, *gradients, sums = torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 0.5, name,
                                                                      param, mask, 1.0, False, kept)
            plain, *plain_gradients, _ = torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 0.5,
                                                                           name, param, [*mask[:2], False])
        torch.testing.assert_close(out, plain)
        for gradient, plain_gradient in zip(gradients, plain_gradients):
            assert torch.equal(gradient, plain_gradient)
        if mask[2]:
            assert sums.dtype == torch.float64 and sums.shape == input.shape[:kept]
            torch.testing.assert_close(sums, expected_sums)
        else:
            assert sums.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, kept", [((2, 3, 0), 2), ((2, 0, 5), 1), ((0, 2, 8192), 1), ((0, 1, 1), 0)], ids=str)
def test_weighted_loss_sums_empty_rows_to_zero(device, shape, kept):
    """An empty loss with weight_kept_dims: each row's sum is 0 (none where there is no
    row), with the operands' gradients or alone, and the loss 0."""
    input, target, name, param = _sample_args(device, "mse", shape=shape)
    weight = torch.rand(shape[:kept] + (1,) * (len(shape) - kept), device=device)
    for mask in ([False, False, True], [True, True, True]):
        with torch.no_grad():
            out, grad_input, grad_target, sums = torch.ops.fusedloss.weighted_loss(
                input, target, weight, None, None, 0.5, name, param, mask, 1.0, False, kept)
        assert out.item() == 0 and grad_input.numel() == 0 and grad_target.numel() == 0
        assert sums.shape == shape[:kept] and sums.dtype == torch.float64 and not sums.any()


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_loss_refuses_weight_kept_dims_that_do_not_fit(device):
    input, target, name, param = _sample_args(device, "mse", shape=(2, 3, ops.ROW_TILING_MULTIPLE))
    for weight, kept in ((torch.rand(2, 3, 1, device=device), 1), (torch.rand(2, 1, 1, device=device), 3)):
        with pytest.raises(RuntimeError, match="weight_kept_dims"):
            torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 1.0, name, param,
                                              [False, False, True], 1.0, False, kept)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gradcheck_float64(device, loss, reduction):
    # Keep |input - target| away from the kinks so finite differences are valid.
    input = (torch.rand(4, 6, dtype=torch.float64, device=device) * 4 - 2).requires_grad_()
    target = torch.zeros(1, 6, dtype=torch.float64, device=device)
    target += torch.sign(torch.randn_like(target)) * 0.1
    target.requires_grad_()
    far_from_kinks = (input - target).abs()
    far_from_kinks = ((far_from_kinks - PARAMS[loss]).abs() > 1e-2) & (far_from_kinks > 1e-2)
    input = torch.where(far_from_kinks, input, input + 0.05).detach().requires_grad_()

    def fn(input, target):
        if reduction == "none":
            return torch.ops.fusedloss.pointwise_loss(input, target, loss, PARAMS[loss])
        return torch.ops.fusedloss.reduced_loss(input, target, loss, PARAMS[loss], reduction, [True, True])[0]

    assert torch.autograd.gradcheck(fn, (input, target))
    assert torch.autograd.gradgradcheck(fn, (input, target))
    if reduction != "none":
        weight = torch.rand(4, 1, dtype=torch.float64, device=device) - 0.25  # of either sign

        def weighted(input, target):
            return torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 0.7, loss, PARAMS[loss],
                                                     [True, True, False])[0]

        assert torch.autograd.gradcheck(weighted, (input, target))
        assert torch.autograd.gradgradcheck(weighted, (input, target))

        # The weight's and the divisor's gradients, written in the forward's pass or not.
        divisor = (torch.rand((), dtype=torch.float64, device=device) + 0.5).requires_grad_()
        weight.requires_grad_()
        for mask in ([True, True, True], [False, False, False]):
            def with_weight(input, target, weight, divisor, mask=mask):
                return torch.ops.fusedloss.weighted_loss(input, target, weight, None, divisor, 0.7, loss,
                                                         PARAMS[loss], mask)[0]

            assert torch.autograd.gradcheck(with_weight, (input, target, weight, divisor))
            assert torch.autograd.gradgradcheck(with_weight, (input, target, weight, divisor))
            # the weight's gradient alone, which the kernels write only beside an operand's
            assert torch.autograd.gradcheck(lambda weight: with_weight(input.detach(), target.detach(), weight,
                                                                       divisor.detach()), (weight,))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gradient_is_written_only_when_asked(device):
    input, target = torch.randn(10, device=device), torch.randn(10, device=device)
    _, grad_input, grad_target = torch.ops.fusedloss.reduced_loss(input, target, "mse", 0.0, "sum", [False, False])
    assert grad_input.numel() == 0 and grad_target.numel() == 0
    _, grad_input, grad_target = torch.ops.fusedloss.reduced_loss(input, target, "mse", 0.0, "sum", [True, False])
    torch.testing.assert_close(grad_input, 2 * (input - target))
    assert grad_target.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_fused_gradient_becomes_grad_without_a_copy(device, grad_scale):
    input = torch.randn(1000, device=device, requires_grad=True)
    target = torch.randn(1000, device=device)
    out, grad_input, _ = torch.ops.fusedloss.reduced_loss(input, target, "huber", 1.0, "mean", [True, False])
    buffer = grad_input.data_ptr()
    del grad_input
    (out * grad_scale).backward()
    assert input.grad.data_ptr() == buffer


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_dropped_without_backward_frees_its_gradient_buffers(device):
    """The node keeps the buffers for backward; nothing may keep the node."""
    input = torch.randn(1000, device=device, requires_grad=True)
    target = torch.randn(1000, device=device, requires_grad=True)
    out, grad_input, grad_target = torch.ops.fusedloss.reduced_loss(input, target, "mse", 0.0, "sum", [True, True])
    buffers = [weakref.ref(grad_input.untyped_storage()), weakref.ref(grad_target.untyped_storage())]
    del out, grad_input, grad_target
    gc.collect()
    assert [ref() for ref in buffers] == [None, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", losses.LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_without_fused_gradients_gives_their_bits(device, loss, reduction):
    """A forward that wrote no gradient (output_mask all False): backward recomputes it,
    as the fused gradient scaled in place would be, bit for bit."""
    input, target, name, param = _sample_args(device, loss, shape=(37, 11))
    grads = []
    for mask in ([True, True], [False, False]):
        out = torch.ops.fusedloss.reduced_loss(input, target, name, param, reduction, mask)[0]
        grads.append(torch.autograd.grad(out * 0.37, (input, target)))
    for fused, recomputed in zip(*grads):
        assert torch.equal(fused, recomputed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", LOSSES)
def test_functional_asks_for_no_fused_gradient_without_grad(device, name, monkeypatch):
    calls = []
    real = routing.apply
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)  # every forward through routing.apply
    monkeypatch.setattr(routing, "apply", lambda function, op, differentiable, *args: calls.append(args[5])
                        or real(function, op, differentiable, *args))
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)
    if device == "cpu":
        monkeypatch.setattr(build, "load", lambda *families: {})
        monkeypatch.setattr(routing, "kernels_apply", lambda *a: True)
    x = torch.randn(8, device=device, requires_grad=True)
    y = torch.randn(8, device=device)
    with torch.no_grad():
        assert not LOSSES[name][0](x, y).requires_grad
    assert not LOSSES[name][0](x.detach(), y).requires_grad
    assert LOSSES[name][0](x, y).requires_grad
    assert calls == [[False, False], [False, False], [True, False]]


def test_a_weighted_forward_writes_gradients_from_a_quarter_of_the_threshold(monkeypatch):
    """The weighted family's step is bound by host time below the plain threshold either
    way: its forward writes the gradients from a quarter of it, the plain one's from it."""
    x, y = torch.empty(1000), torch.empty(1000)  # 8000 bytes together
    for threshold, plain, weighted in ((8000, True, True), (32000, False, True), (32004, False, False)):
        monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
        assert routing.forward_writes_gradients(x, y, 1000) is plain
        assert routing.forward_writes_gradients(x, y, 1000, weighted=True) is weighted


@pytest.mark.parametrize("device", DEVICES)
def test_small_losses_leave_the_gradient_to_backward(device, monkeypatch):
    """Below FUSED_GRADIENT_FROM_BYTES a step is bound by host time: no fused gradient,
    no grad_output prediction; from there on the forward writes it."""
    calls = []
    real = routing.apply
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)  # every forward through routing.apply
    monkeypatch.setattr(routing, "apply", lambda function, op, differentiable, *args: calls.append((args[5], args[6]))
                        or real(function, op, differentiable, *args))
    if device == "cpu":
        monkeypatch.setattr(build, "load", lambda *families: {})
        monkeypatch.setattr(routing, "kernels_apply", lambda *a: True)
    x = torch.randn(1000, device=device, requires_grad=True)
    fusedloss.mse_loss(x, torch.randn(1000, device=device)).backward()
    assert calls == [([False, False], -1)]
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 1000 * 8)
    fusedloss.mse_loss(x, torch.randn(1000, device=device)).backward()
    assert calls[1][0] == [True, False]
    # A broadcast pair counts the broadcast elements: 1000 x 8 of them here.
    x = torch.randn(1000, 1, device=device, requires_grad=True)
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 1000 * 8 * 8)
    with pytest.warns(UserWarning):
        fusedloss.mse_loss(x, torch.randn(8, device=device)).backward()
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 1000 * 8 * 8 + 1)
    with pytest.warns(UserWarning):
        fusedloss.mse_loss(x, torch.randn(8, device=device)).backward()
    assert [mask for mask, _ in calls[2:]] == [[True, False], [False, False]]


@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_serves_the_steps_where_its_step_is_faster(device, monkeypatch):
    """A step (gradients wanted) of a loss PyTorch computes with kernels of its own is
    PyTorch's, with its bits, for 'none' and below FUSED_GRADIENT_FROM_BYTES, with or
    without the C++ autograd; without it, so is one of a loss it composes (L1) below that
    threshold only, and a weighted one below a quarter of it. Other losses, calls without
    gradients, larger steps, and with the C++ autograd the composed and weighted steps (but
    for a weight or scale that learns) take the kernels."""
    monkeypatch.setattr(routing, "pytorch_serves_the_step", PYTORCH_SERVES_THE_STEP)
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)
    calls = []
    real = routing.apply
    monkeypatch.setattr(routing, "apply", lambda function, op, *args: calls.append(op) or real(function, op, *args))
    if device == "cpu":
        monkeypatch.setattr(build, "load", lambda *families: {})
        monkeypatch.setattr(routing, "kernels_apply", lambda *a: True)
    y = torch.randn(1000, device=device)
    for name, row in losses.LOSSES.items():
        function, _, keyword = LOSSES[name]
        kwargs = loss_kwargs(name, PARAMS[name])
        for reduction in ("mean", "sum", "none"):
            calls.clear()
            x = torch.randn(1000, device=device, requires_grad=True)
            out = function(x, y, reduction=reduction, **kwargs)
            (out * 0.37).sum().backward()
            assert bool(calls) != row.pytorch_serves_steps, (name, reduction)
            if row.pytorch_serves_steps:
                x2 = x.detach().clone().requires_grad_()
                expected = row.torch_function(x2, y, reduction=reduction, **kwargs)
                (expected * 0.37).sum().backward()
                assert torch.equal(out, expected) and torch.equal(x.grad, x2.grad)
            calls.clear()
            with torch.no_grad():
                function(x, y, reduction=reduction, **kwargs)
            assert len(calls) == 1, (name, reduction)
    # a broadcast pair: PyTorch's warning once, and PyTorch's bits
    x = torch.randn(1000, 1, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with pytest.warns(UserWarning, match="target size") as caught:
        out = fusedloss.huber_loss(x, y[:8], delta=0.5)
    with pytest.warns(UserWarning, match="target size"):
        expected = torch.nn.functional.huber_loss(x2, y[:8], delta=0.5)
    out.backward()
    expected.backward()
    assert len(caught) == 1 and torch.equal(out, expected) and torch.equal(x.grad, x2.grad)
    x = torch.randn(1000, device=device, requires_grad=True)
    # a weighted step below a quarter of the threshold: PyTorch's loss and torch operations, with their bits
    weight = torch.rand(1000, device=device)
    weighted_calls = {
        "weight": lambda f, a: f(a, y, weight=weight),
        "mask and a count": lambda f, a: f(a, y, weight=(weight > 0.5).float(), reduction="sum",
                                           scale=1 / (weight > 0.5).sum()),
        "scale": lambda f, a: f(a, y, scale=0.5)}
    for name, row in losses.LOSSES.items():
        function = LOSSES[name][0]
        kwargs = loss_kwargs(name, PARAMS[name])
        for label, call in weighted_calls.items():
            for threshold, served in ((1 << 28, row.pytorch_serves_steps), (1000 * 8 * 4, False)):
                monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", threshold)
                calls.clear()
                x = torch.randn(1000, device=device, requires_grad=True)
                out = call(lambda *a, **k: function(*a, **k, **kwargs), x)
                out.backward()
                assert bool(calls) != served, (name, label, threshold)
                x2 = x.detach().clone().requires_grad_()
                monkeypatch.setattr(routing, "pytorch_serves_the_step", lambda *args: False)
                expected = call(lambda *a, **k: function(*a, **k, **kwargs), x2)
                expected.backward()
                monkeypatch.setattr(routing, "pytorch_serves_the_step", PYTORCH_SERVES_THE_STEP)
                rtol, atol = TOLERANCE[torch.float32]
                torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
                torch.testing.assert_close(x.grad, x2.grad, rtol=rtol, atol=atol)
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 1000 * 8)  # a mean whose forward writes the gradient
    for function, fused_reductions in ((fusedloss.mse_loss, ["mean"]), (fusedloss.l1_loss, ["mean", "none"])):
        for reduction in ("mean", "none"):
            calls.clear()
            function(x, y, reduction=reduction).sum().backward()
            assert bool(calls) == (reduction in fused_reductions), (function, reduction)
            calls.clear()  # below the threshold, PyTorch's
            function(x[:100], y[:100], reduction=reduction).sum().backward()
            assert not calls, (function, reduction)
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 1 << 28)
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: True)
    for name in ("mse", "l1"):
        # with the C++ autograd, PyTorch's step still where PyTorch has the loss's kernels
        served = losses.LOSSES[name].pytorch_kernels
        assert routing.pytorch_serves_the_step(losses.LOSSES[name], "mean", x, y, x.numel()) == served
        assert routing.pytorch_serves_the_step(losses.LOSSES[name], "none", x, y, x.numel()) == served
        assert not routing.pytorch_serves_the_step(losses.LOSSES[name], "mean", x, y, x.numel(), True)
        # a weight or scale that learns: only the Python autograd gives its gradient
        assert routing.pytorch_serves_the_step(losses.LOSSES[name], "mean", x, y, x.numel(), True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_call_pytorch_serves_goes_straight_to_its_operator(device, monkeypatch):
    """A step PyTorch serves (plain tensors of one shape wanting gradients; no weight, scale,
    dim or legacy argument; a float param in its domain) is found before the kernels' checks
    and is PyTorch's operator, with PyTorch's bits and gradients. Every other call takes the
    usual route, which honours what it holds (here: the checks run, and raise). On a GPU
    the first call loads the kernels (and the C++ autograd, where it is built)."""
    if device == "cuda":
        build.load("plain")
    monkeypatch.setattr(routing, "pytorch_serves_the_step", PYTORCH_SERVES_THE_STEP)
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)

    def usual_route(*args):
        raise AssertionError("the usual route's checks ran")

    monkeypatch.setattr(routing, "kernels_apply", usual_route)
    y = torch.randn(257, device=device)
    for name, row in losses.LOSSES.items():
        if not row.pytorch_serves_steps:
            continue
        function, _, keyword = LOSSES[name]
        kwargs = loss_kwargs(name, PARAMS[name])
        for reduction in ("mean", "sum", "none"):
            x = torch.randn(257, device=device, requires_grad=True)
            x2 = x.detach().clone().requires_grad_()
            out = function(x, y, reduction=reduction, **kwargs)
            expected = row.torch_function(x2, y, reduction=reduction, **kwargs)
            (out * 0.37).sum().backward()
            (expected * 0.37).sum().backward()
            assert torch.equal(out, expected) and torch.equal(x.grad, x2.grad), (name, reduction)
        x = torch.randn(257, device=device, requires_grad=True)
        others = [lambda: function(x.detach(), y, **kwargs),  # no gradient wanted
                  lambda: function(x[:, None], y, **kwargs),  # a target that broadcasts
                  lambda: function(x, y, reduction="batchmean", **kwargs),
                  lambda: function(x, y, scale=2.0, **kwargs),
                  lambda: function(x, y, weight=torch.ones_like(y), **kwargs),
                  lambda: function(x[None], y[None], dim=1, **kwargs)]
        if row.param:
            others.append(lambda: function(x, y, **{keyword: 1}))
        if row.param_zero_is:
            others.append(lambda: function(x, y, **{keyword: 0.0}))
        if row.function != "huber_loss":  # PyTorch's legacy arguments
            others.append(lambda: function(x, y, size_average=False))
        for call in others:
            with pytest.raises(AssertionError, match="usual route"):
                call()
        with torch.device(device), pytest.raises(AssertionError, match="usual route"):  # a torch function mode
            function(x, y, **kwargs)
        # under torch.func's grad a call is served too, and gets PyTorch's gradient
        ours = torch.func.grad(lambda a: function(a, y, **kwargs))(x.detach())
        assert torch.equal(ours, torch.func.grad(lambda a: row.torch_function(a, y, **kwargs))(x.detach())), name
    if device == "cuda":  # before the kernels' first call, a GPU's call takes the usual route, which loads them
        monkeypatch.setattr(build, "_loaded", {})
        with pytest.raises(AssertionError, match="usual route"):
            fusedloss.mse_loss(torch.randn(257, device=device, requires_grad=True), y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_loss_dtype_rule_matches_torch(dtype):
    for other in FLOAT_DTYPES:
        a, b = torch.ones(2, dtype=dtype), torch.ones(2, dtype=other)
        for loss, (_, torch_fn, _keyword) in LOSSES.items():
            assert formulas.loss_dtype(dtype, other, loss) == torch_fn(a, b, **loss_kwargs(loss, 1.0)).dtype


def test_package_exports():
    """The public function of every row of the table of losses, the likelihoods', and the modules."""
    expected = [row.function for row in losses.LOSSES.values()] + ["gaussian_nll_loss", "poisson_nll_loss", "nn"]
    assert sorted(fusedloss.__all__) == sorted(expected)
    for row in losses.LOSSES.values():
        assert callable(getattr(fusedloss, row.function)) and getattr(fusedloss, row.function).__doc__


@requires_cuda
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("mse", 0.0, "bogus"), "reduction must be 'mean' or 'sum', got 'bogus'"),
        (("smooth_l1", -1.5, "mean"), "smooth_l1 needs beta > 0, got -1.5"),
        (("nope", 0.0, "mean"), "unknown loss 'nope'"),
    ],
)
def test_cuda_kernels_reject_invalid_arguments_with_an_error(args, message):
    # The messages format numbers and strings in the extension's own code: a
    # second copy of the C++ library there once crashed the process instead.
    x = torch.randn(4, device="cuda")
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
        torch.ops.fusedloss.reduced_loss(x, x, *args, [False, False])


@requires_cuda
def test_cuda_kernels_reject_shapes_that_do_not_broadcast():
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(4\) at "
                                           "non-singleton dimension 1"):
        torch.ops.fusedloss.pointwise_loss(torch.randn(2, 3, device="cuda"), torch.randn(2, 4, device="cuda"),
                                           "mse", 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", [name for name, row in losses.LOSSES.items() if row.takes_param_tensor])
@pytest.mark.parametrize("param_shape", [(), (5, 1), (1, 7), (5, 7)], ids=str)
def test_weighted_loss_takes_a_param_per_element(device, loss, param_shape):
    """param_per_element: the weight holds each element's param and multiplies nothing. The
    loss and its gradients are those of the formula with those params, through opcheck, as
    the forward writes them and as backward computes them."""
    input, target, name, number = _sample_args(device, loss)  # the number: unused, but checked
    param = torch.rand(param_shape, device=device) * 0.9 + 0.05
    x64, t64 = input.detach().double().requires_grad_(), target.detach().double().requires_grad_()
    expected = losses.LOSSES[loss].reference(x64, t64, "none", param.double()).sum() * 0.5
    want = torch.autograd.grad(expected, (x64, t64), torch.tensor(0.37, dtype=torch.float64))
    rtol, atol = TOLERANCE[torch.float32]  # float32 results against float64's
    for mask in ([True, True, False], [True, False, False], [False, False, False]):
        # (backward corrects the forward's gradients in place for a grad_output not expected)
        torch.library.opcheck(torch.ops.fusedloss.weighted_loss,
                              (input, target, param, None, None, 0.5, name, number, mask, 1.0, False, -1, True))
        with torch.no_grad():
            out, grad_input, grad_target, grad_param = torch.ops.fusedloss.weighted_loss(
                input, target, param, None, None, 0.5, name, number, mask, 0.37, False, -1, True)
        torch.testing.assert_close(out.double(), expected.detach(), rtol=rtol, atol=atol)
        assert grad_param.numel() == 0
        for written, wanted, gradient in zip(mask, want, (grad_input, grad_target)):
            if written:
                torch.testing.assert_close(gradient.double(), wanted, rtol=rtol, atol=atol)
    gradients = torch.ops.fusedloss.weighted_loss_backward(torch.tensor(0.37, device=device), input.detach(),
                                                           target.detach(), param, None, None, 0.5, name, number,
                                                           [True, True, False], -1, 1.0, False, True)
    for gradient, wanted in zip(gradients, want):
        torch.testing.assert_close(gradient.double(), wanted, rtol=rtol, atol=atol)
    torch.library.opcheck(torch.ops.fusedloss.weighted_loss_backward,
                          (torch.tensor(0.37, device=device), input.detach(), target.detach(), param, None, None,
                           0.5, name, number, [True, False, False], -1, 1.0, False, True))


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_loss_refuses_a_param_per_element_it_cannot_take(device):
    """A loss whose param is a number only, no param, the param's gradient, and rows."""
    input, target, _, _ = _sample_args(device, "quantile", shape=(2, ops.ROW_TILING_MULTIPLE))
    param = torch.rand(2, 1, device=device)
    for args in (("mse", param, [True, False, False], -1), ("smooth_l1", param, [True, False, False], -1),
                 ("quantile", None, [True, False, False], -1), ("quantile", param, [True, False, True], -1),
                 ("quantile", param, [False, False, False], 1)):
        loss, weight, mask, kept = args
        with pytest.raises(RuntimeError, match="param_per_element|param per element|invalid argument"):
            torch.ops.fusedloss.weighted_loss(input, target, weight, None, None, 1.0, loss, 0.5, mask, 1.0, False,
                                              kept, True)
    out = torch.ops.fusedloss.weighted_loss(input, target, param.requires_grad_(), None, None, 1.0, "quantile", 0.0,
                                            [False, False, False], 1.0, False, -1, True)[0]
    with pytest.raises(RuntimeError, match="no gradient for a param per element"):
        torch.autograd.grad(out, param)
