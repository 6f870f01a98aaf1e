"""The table of losses: each loss's PyTorch reference and derivative, in plain torch.

One row per loss, under the names of the CUDA side's table (``csrc/losses.cuh``).
``formulas``, ``ops`` and ``functional`` read it; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Loss:
    """A row of the table of losses: PyTorch's loss and its derivative, in plain torch."""

    # torch.nn.functional's loss of (input, target, reduction, beta or delta)
    reference: Callable[[Tensor, Tensor, str, float], Tensor]
    # d loss / d input as a function of d = input - target (and beta or delta)
    gradient: Callable[[Tensor, float], Tensor]
    # PyTorch returns the input's dtype, not the promoted one
    keeps_input_dtype: bool = False


# The Python side of the table of losses; csrc/losses.cuh holds the CUDA side,
# under the same names. A new elementwise loss is a row in each, its public
# function in functional.py, and its module in nn.py.
LOSSES: dict[str, Loss] = {
    "mse": Loss(lambda i, t, reduction, _: F.mse_loss(i, t, reduction=reduction), lambda d, _: 2 * d),
    "l1": Loss(lambda i, t, reduction, _: F.l1_loss(i, t, reduction=reduction), lambda d, _: d.sgn()),
    "smooth_l1": Loss(
        lambda i, t, reduction, beta: F.smooth_l1_loss(i, t, reduction=reduction, beta=beta),
        lambda d, beta: (d / beta).clamp(-1, 1),
    ),
    "huber": Loss(
        lambda i, t, reduction, delta: F.huber_loss(i, t, reduction=reduction, delta=delta),
        lambda d, delta: d.clamp(-delta, delta),
        keeps_input_dtype=True,
    ),
    "pseudo_huber": Loss(
        lambda i, t, reduction, c: reduced(pseudo_huber_elementwise(i, t, c), reduction),
        lambda d, c: 2 * c * d / torch.sqrt(d * d + c * c),
    ),
}


def pseudo_huber_elementwise(input: Tensor, target: Tensor, c: float | Tensor) -> Tensor:
    """2c(sqrt(d^2 + c^2) - c) in at least float32 (as diffusers casts first), written as the
    kernels write it: 2c d^2 / (sqrt(d^2 + c^2) + c) where |d| <= c, which keeps small d's
    digits. Returned in the promoted dtype of the operands."""
    d = input - target
    x = d.to(torch.promote_types(d.dtype, torch.float32))
    if isinstance(c, Tensor):
        c = c.to(torch.promote_types(c.dtype, x.dtype))
    root = torch.sqrt(x * x + c * c)
    near = torch.where(x.abs() <= c, x * x / (root + c), root - c)
    return (2 * c * near).to(d.dtype)


def reduced(per_element: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per_element
    if reduction == "sum":
        return per_element.sum()
    if reduction == "mean":
        return per_element.mean()
    raise ValueError(f"Invalid reduction mode: {reduction}. Expected one of 'none', 'mean', 'sum'.")
