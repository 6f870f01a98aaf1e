"""The losses written with plain torch operations, from the table of losses
(``fusedloss.losses.LOSSES``).

These are the reference semantics the CUDA kernels follow. They serve as the
operators' CPU kernels and as the differentiable gradient used when a graph of
the gradient itself is built (``create_graph=True``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .losses import LOSSES


def loss_dtype(input_dtype: torch.dtype, target_dtype: torch.dtype, loss: str) -> torch.dtype:
    """PyTorch's result dtype: the promoted pair, or the input's for a loss that keeps it (Huber)."""
    return input_dtype if LOSSES[loss].keeps_input_dtype else torch.promote_types(input_dtype, target_dtype)


def torch_loss(input: Tensor, target: Tensor, loss: str, param: float, reduction: str) -> Tensor:
    """The loss through torch.nn.functional, broadcast first so no warning is repeated."""
    input, target = torch.broadcast_tensors(input, target)
    return LOSSES[loss].reference(input, target, reduction, param)


def loss_grad(input: Tensor, target: Tensor, loss: str, param: float, times: Tensor | float = 1.0) -> Tensor:
    """d loss / d input per element times `times` (grad_output, 1/N, a weight), rounded once into
    the promoted dtype; d / d target is its negative."""
    # Broadcast first, as the losses do: a 0-d operand must not lose its dtype in promotion.
    input, target = torch.broadcast_tensors(input, target)
    dtype = torch.promote_types(input.dtype, target.dtype)
    # float64 math, so that the one rounding into `dtype` is the only one (beta or delta may
    # not fit in fp16); the difference held in fp16 only for fp16, as PyTorch's fp16 kernels hold it.
    math = torch.float64
    d = input.to(math) - target.to(math)
    if dtype == torch.float16:
        d = d.to(dtype).to(math)
    return (LOSSES[loss].gradient(d, param) * times).to(dtype)
