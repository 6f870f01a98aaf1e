"""Pseudo-Huber with a tensor c: torch operations with the derivatives written out (the
fused kernels take c as a number)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops, routing
from .losses import pseudo_huber_elementwise, reduced


class PseudoHuberWithTensorC(torch.autograd.Function):
    """Pseudo-Huber for a tensor c (eager, outside torch.func), with its derivatives written
    out: 2c d / root for the operands and 2 (root - c)^2 / root for c. Autograd through the
    formula would take about twice as many passes over N, as a user's own formula does.
    A mean's 1 / N rides on the factor 2c, which backward reuses: a small step is bound by
    its launches. A double backward differentiates the formula itself."""

    @staticmethod
    def forward(ctx, input: Tensor, target: Tensor, c: Tensor, reduction: str) -> Tensor:
        dtype = torch.promote_types(input.dtype, target.dtype)
        math = torch.promote_types(dtype, torch.float32)  # as the kernels (and diffusers) compute it
        x = input.to(math) - target
        c_math = c.to(torch.promote_types(c.dtype, math))
        root = torch.hypot(x, c_math)
        # root - c as d (d / (root + c)): no cancellation for |d| << c, a finite loss where d^2
        # would overflow (|d / (root + c)| < 1), and, with root bounded, an infinite d's loss
        # infinite rather than inf / inf. Four passes where selecting between two forms takes eight.
        near = x * (x / _bounded(root).add_(c_math))
        # A mean as the sum of 2c / N times near (an empty mean stays 0 / 0 = NaN).
        numel = root.numel()
        ctx.per_element = 2 / numel if reduction == "mean" and numel else 2.0
        factor = c_math * ctx.per_element
        ctx.save_for_backward(input, target, c, x, root, factor, near if ctx.needs_input_grad[2] else None)
        ctx.reduction = reduction
        loss = near * factor if ctx.needs_input_grad[2] else near.mul_(factor)
        if reduction == "none":
            return loss.to(dtype)
        return (loss.mean() if reduction == "mean" and not numel else loss.sum()).to(dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, target, c, x, root, factor, near = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph: the formula's derivatives, differentiable again
            with torch.enable_grad():
                loss = reduced(pseudo_huber_elementwise(input, target, c), ctx.reduction)
            grads = iter(torch.autograd.grad(loss, [t for t, w in zip((input, target, c), wanted) if w], grad_output,
                                             create_graph=True))
            return tuple(next(grads) if w else None for w in wanted) + (None,)
        # factor has the forward's math dtype (a float64 c widens it), which promotion keeps
        slope = x.div(root).mul_(factor * grad_output) if wanted[0] or wanted[1] else None
        grad_input = slope.to(input.dtype).sum_to_size(input.shape) if wanted[0] else None
        grad_target = slope.neg().to(target.dtype).sum_to_size(target.shape) if wanted[1] else None
        grad_c = None
        if wanted[2]:
            # 2 (root - c)^2 / root, written so that an infinite d gives inf, not inf / inf
            times = grad_output.to(root.dtype) * ctx.per_element
            grad_c = near.div(_bounded(root)).mul_(near).mul_(times).sum_to_size(c.shape).to(c.dtype)
        return grad_input, grad_target, grad_c, None


def _bounded(root: Tensor) -> Tensor:
    return root.clamp(max=torch.finfo(root.dtype).max)


def pseudo_huber_formula(input: Tensor, target: Tensor, c: float | Tensor, reduction: str = "none") -> Tensor:
    input, target = ops.as_computed(input, target, routing.under_autocast(input, target, input.device.type))
    if (isinstance(c, Tensor) and not torch.compiler.is_compiling() and not routing.under_a_transform()
            and routing.no_torch_function(input, target, c)):
        return PseudoHuberWithTensorC.apply(input, target, c, reduction)
    return reduced(pseudo_huber_elementwise(input, target, c), reduction)
