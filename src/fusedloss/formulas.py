"""The losses written with plain torch operations.

These are the reference semantics the CUDA kernels follow. They serve as the
operators' CPU kernels and as the differentiable gradient used when a graph of
the gradient itself is built (``create_graph=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("mse", "l1", "smooth_l1", "huber")


def loss_dtype(input_dtype: torch.dtype, target_dtype: torch.dtype, loss: str) -> torch.dtype:
    """PyTorch's result dtype: the promoted pair, except Huber keeps the input's."""
    return input_dtype if loss == "huber" else torch.promote_types(input_dtype, target_dtype)


def torch_loss(input: Tensor, target: Tensor, loss: str, param: float, reduction: str) -> Tensor:
    """The loss through torch.nn.functional, broadcast first so no warning is repeated."""
    input, target = torch.broadcast_tensors(input, target)
    if loss == "mse":
        return F.mse_loss(input, target, reduction=reduction)
    if loss == "l1":
        return F.l1_loss(input, target, reduction=reduction)
    if loss == "smooth_l1":
        return F.smooth_l1_loss(input, target, reduction=reduction, beta=param)
    return F.huber_loss(input, target, reduction=reduction, delta=param)


def loss_grad(input: Tensor, target: Tensor, loss: str, param: float) -> Tensor:
    """d loss / d input per element, in the promoted dtype; d / d target is its negative."""
    # Broadcast first, as the losses do: a 0-d operand must not lose its dtype in promotion.
    input, target = torch.broadcast_tensors(input, target)
    d = input - target
    # fp32 math for 16-bit data, as the kernels do; beta or delta may not fit in fp16.
    x = d.to(torch.promote_types(d.dtype, torch.float32))
    if loss == "mse":
        grad = 2 * x
    elif loss == "l1":
        grad = x.sgn()
    elif loss == "smooth_l1":
        grad = (x / param).clamp(-1, 1)
    else:
        grad = x.clamp(-param, param)
    return grad.to(d.dtype)
