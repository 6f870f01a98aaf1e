"""The table of losses: each loss's PyTorch reference and derivative, in plain torch.

One row per loss, under the names of the CUDA side's table (``csrc/losses.cuh``).
The rest of the package reads it; it imports none of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Loss:
    """A row of the table of losses. The public function and module, the operators' loss
    names, the dtype rules and the test matrices all come from these rows."""

    # the public function's name, which is torch.nn.functional's where ``pytorch`` is set
    function: str
    # the module's class name in fusedloss.nn, which subclasses torch.nn's where ``pytorch`` is set
    module: str
    # the loss of (input, target, reduction, param) in plain torch: PyTorch's own, or the formula
    reference: Callable[[Tensor, Tensor, str, float], Tensor]
    # d loss / d input as a function of d = input - target (and the param)
    gradient: Callable[[Tensor, float], Tensor]
    # PyTorch has this loss, under the same function and module names
    pytorch: bool = False
    # the keyword of the loss's number (beta, delta, c), its default, and whether 0 is allowed
    param: str | None = None
    param_default: float = 1.0
    # the loss that a param of 0 is, as Smooth L1 with beta = 0 is L1; without one, 0 is invalid
    param_zero_is: str | None = None
    # PyTorch returns the input's dtype, not the promoted one (kOutputHasInputDtype)
    keeps_input_dtype: bool = False
    # PyTorch's CUDA backward computes each gradient in its operand's dtype (kGradInOwnDtype)
    gradient_in_own_dtype: bool = False
    # a weighted mean divides by the element count, not the weight's sum (PyTorch's weighted Huber)
    weighted_mean_over_count: bool = False

    @property
    def torch_function(self) -> Callable[..., Tensor] | None:
        """torch.nn.functional's function for this loss, where PyTorch has it."""
        return getattr(F, self.function) if self.pytorch else None

    def param_valid(self, value: float) -> bool:
        """The param's domain (NaN is outside it)."""
        return value > 0 or (value == 0 and self.param_zero_is is not None)


# The Python side of the table of losses; csrc/losses.cuh holds the CUDA side,
# under the same names. A new elementwise loss is a row in each, and its public
# function in functional.py.
LOSSES: dict[str, Loss] = {
    "mse": Loss(
        "mse_loss", "MSELoss",
        lambda i, t, reduction, _: F.mse_loss(i, t, reduction=reduction),
        lambda d, _: 2 * d,
        pytorch=True,
    ),
    "l1": Loss(
        "l1_loss", "L1Loss",
        lambda i, t, reduction, _: F.l1_loss(i, t, reduction=reduction),
        lambda d, _: d.sgn(),
        pytorch=True,
    ),
    "smooth_l1": Loss(
        "smooth_l1_loss", "SmoothL1Loss",
        lambda i, t, reduction, beta: F.smooth_l1_loss(i, t, reduction=reduction, beta=beta),
        lambda d, beta: (d / beta).clamp(-1, 1),
        pytorch=True, param="beta", param_zero_is="l1", gradient_in_own_dtype=True,
    ),
    "huber": Loss(
        "huber_loss", "HuberLoss",
        lambda i, t, reduction, delta: F.huber_loss(i, t, reduction=reduction, delta=delta),
        lambda d, delta: d.clamp(-delta, delta),
        pytorch=True, param="delta", keeps_input_dtype=True, weighted_mean_over_count=True,
    ),
    "pseudo_huber": Loss(
        "pseudo_huber_loss", "PseudoHuberLoss",
        lambda i, t, reduction, c: reduced(pseudo_huber_elementwise(i, t, c), reduction),
        lambda d, c: 2 * c * d / torch.sqrt(d * d + c * c),
        param="c",
    ),
    "log_cosh": Loss(
        "log_cosh_loss", "LogCoshLoss",
        lambda i, t, reduction, _: reduced(log_cosh_elementwise(i, t), reduction),
        lambda d, _: torch.tanh(d),
    ),
}


def pseudo_huber_elementwise(input: Tensor, target: Tensor, c: float | Tensor) -> Tensor:
    """2c(sqrt(d^2 + c^2) - c) in at least float32 (as diffusers casts first), written as the
    kernels write it: 2c d^2 / (sqrt(d^2 + c^2) + c) where |d| <= c, which keeps small d's
    digits. Returned in the promoted dtype of the operands, broadcast first as PyTorch's
    losses are (a 0-d operand keeps its part in the promotion)."""
    d = torch.sub(*torch.broadcast_tensors(input, target))
    x = d.to(torch.promote_types(d.dtype, torch.float32))
    if isinstance(c, Tensor):
        c = c.to(torch.promote_types(c.dtype, x.dtype))
    # hypot and the square taken where |d| <= c only: a d whose square overflows keeps its
    # finite loss and gradient, as the kernels' do
    root = torch.hypot(x, c if isinstance(c, Tensor) else torch.as_tensor(c, dtype=x.dtype, device=x.device))
    inside = x.abs() <= c
    near_x = torch.where(inside, x, 0)
    near = torch.where(inside, near_x * near_x / (root + c), root - c)
    return (2 * c * near).to(d.dtype)


def log_cosh_elementwise(input: Tensor, target: Tensor) -> Tensor:
    """log(cosh(d)) in at least float32, as the kernels write it: log1p(m^2 / (2 (1 + m)))
    with m = expm1(|d|) up to |d| = 1, which keeps small d's digits, and
    |d| + log1p(exp(-2|d|)) - log 2 beyond, which cannot overflow. Returned in the
    promoted dtype of the operands, broadcast first."""
    d = torch.sub(*torch.broadcast_tensors(input, target))
    z = d.to(torch.promote_types(d.dtype, torch.float32)).abs()
    m = torch.expm1(z.clamp(max=1))
    near = torch.log1p(m * m / (2 * (1 + m)))
    far = z + torch.log1p(torch.exp(-2 * z)) - math.log(2)
    return torch.where(z <= 1, near, far).to(d.dtype)


def reduced(per_element: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per_element
    if reduction == "sum":
        return per_element.sum()
    if reduction == "mean":
        return per_element.mean()
    raise ValueError(f"{reduction} is not a valid value for reduction")  # PyTorch's words
