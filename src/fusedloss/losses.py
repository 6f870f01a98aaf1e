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
    # PyTorch computes it with a kernel of its own and its gradient with another (ATen's
    # loss and loss_backward, not a composite of operations), behind a C++ autograd node
    pytorch_kernels: bool = False
    # PyTorch composes it from ATen operations behind C++ autograd nodes (L1: sub, abs, mean):
    # they move more bytes than the fused step, but below routing.FUSED_GRADIENT_FROM_BYTES a
    # step is bound by host time, and they cost less of it than the Python autograd
    pytorch_composite: bool = False
    # the keyword of the loss's number (beta, delta, c, quantiles) and its default
    param: str | None = None
    param_default: float = 1.0
    # the loss that a param of 0 is, as Smooth L1 with beta = 0 is L1
    param_zero_is: str | None = None
    # the param's domain: 0 < value <= param_max, and 0 too where param_zero_is names a
    # loss or param_zero_valid says 0 is this loss's own (a quantile's [0, 1])
    param_max: float = math.inf
    param_zero_valid: bool = False
    # PyTorch returns the input's dtype, not the promoted one (kOutputHasInputDtype)
    keeps_input_dtype: bool = False
    # PyTorch's CUDA backward computes each gradient in its operand's dtype (kGradInOwnDtype)
    gradient_in_own_dtype: bool = False
    # a weighted mean divides by the element count, not the weight's sum (PyTorch's weighted Huber)
    weighted_mean_over_count: bool = False
    # a target of another shape draws PyTorch's warning; not where broadcasting it is the
    # loss's use (a quantile loss's target[..., None] against Q quantiles)
    warns_on_broadcast: bool = True

    @property
    def torch_function(self) -> Callable[..., Tensor] | None:
        """torch.nn.functional's function for this loss, where PyTorch has it."""
        return getattr(F, self.function) if self.pytorch else None

    @property
    def pytorch_serves_steps(self) -> bool:
        """Whether PyTorch's own operator serves some of this loss's steps
        (routing.pytorch_serves_the_step)."""
        return self.pytorch_kernels or self.pytorch_composite

    @property
    def takes_param_tensor(self) -> bool:
        """Whether the param may be a tensor, one per element (fusedloss's own losses; the
        kernels' TakesParamPerElement)."""
        return self.param is not None and not self.pytorch

    def nan_outside_domain(self, param: Tensor) -> Tensor:
        """A tensor param with its elements outside the domain as NaN: their losses are NaN,
        never a plausible number, and nothing waits for the GPU to check them. An integer or
        bool tensor comes back in the default dtype."""
        if not param.is_floating_point():
            param = param.to(torch.get_default_dtype())
        return torch.where(self.param_valid(param), param, math.nan)

    def param_valid(self, value: float | Tensor) -> bool | Tensor:
        """Whether the param lies in its domain (NaN does not); elementwise for a tensor."""
        low = value >= 0 if self.param_zero_is is not None or self.param_zero_valid else value > 0
        # no upper bound to test (NaN already fails the lower one): one launch fewer for a tensor
        return low if self.param_max == math.inf else low & (value <= self.param_max)


# The Python side of the table of losses; csrc/losses.cuh holds the CUDA side,
# under the same names. A new elementwise loss is a row in each, and its public
# function in functional.py.
LOSSES: dict[str, Loss] = {
    "mse": Loss(
        "mse_loss", "MSELoss",
        lambda i, t, reduction, _: F.mse_loss(i, t, reduction=reduction),
        lambda d, _: 2 * d,
        pytorch=True, pytorch_kernels=True,
    ),
    "l1": Loss(
        "l1_loss", "L1Loss",
        lambda i, t, reduction, _: F.l1_loss(i, t, reduction=reduction),
        lambda d, _: d.sgn(),
        pytorch=True, pytorch_composite=True,
    ),
    "smooth_l1": Loss(
        "smooth_l1_loss", "SmoothL1Loss",
        lambda i, t, reduction, beta: F.smooth_l1_loss(i, t, reduction=reduction, beta=beta),
        lambda d, beta: (d / beta).clamp(-1, 1),
        pytorch=True, pytorch_kernels=True, param="beta", param_zero_is="l1", gradient_in_own_dtype=True,
    ),
    "huber": Loss(
        "huber_loss", "HuberLoss",
        lambda i, t, reduction, delta: F.huber_loss(i, t, reduction=reduction, delta=delta),
        lambda d, delta: d.clamp(-delta, delta),
        pytorch=True, pytorch_kernels=True, param="delta", keeps_input_dtype=True, weighted_mean_over_count=True,
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
    "quantile": Loss(
        "quantile_loss", "QuantileLoss",
        lambda i, t, reduction, q: reduced(quantile_elementwise(i, t, q), reduction),
        lambda d, q: quantile_gradient(d, q),
        param="quantiles", param_default=0.5, param_max=1.0, param_zero_valid=True, warns_on_broadcast=False,
    ),
}


def pseudo_huber_elementwise(input: Tensor, target: Tensor, c: float | Tensor) -> Tensor:
    """2c(sqrt(d^2 + c^2) - c) in at least float32 (as diffusers casts first), written as the
    kernels write it: 2c d (d / (sqrt(d^2 + c^2) + c)) where |d| <= c, which keeps small d's
    digits (a tiny d's d^2 would underflow). Returned in the promoted dtype of the operands,
    broadcast first as PyTorch's losses are (a 0-d operand keeps its part in the promotion)."""
    d = torch.sub(*torch.broadcast_tensors(input, target))
    x = d.to(torch.promote_types(d.dtype, torch.float32))
    if isinstance(c, Tensor):
        c = c.to(torch.promote_types(c.dtype, x.dtype))
    # hypot and the square taken where |d| <= c only: a d whose square overflows keeps its
    # finite loss and gradient, as the kernels' do
    root = torch.hypot(x, c if isinstance(c, Tensor) else torch.as_tensor(c, dtype=x.dtype, device=x.device))
    inside = x.abs() <= c
    near_x = torch.where(inside, x, 0)
    near = torch.where(inside, near_x * (near_x / (root + c)), root - c)
    return (2 * c * near).to(d.dtype)


def log_cosh_elementwise(input: Tensor, target: Tensor) -> Tensor:
    """log(cosh(d)) in at least float32, as the kernels write it: log1p(m^2 / (2 (1 + m)))
    with m = expm1(|d|) up to |d| = 1, which keeps small d's digits, and
    |d| + log1p(exp(-2|d|)) - log 2 beyond, which cannot overflow. Returned in the
    promoted dtype of the operands, broadcast first."""
    d = torch.sub(*torch.broadcast_tensors(input, target))
    z = d.to(torch.promote_types(d.dtype, torch.float32)).abs()
    # z beyond 1 held at 1 in the near branch (whose expm1 would overflow into the gradient);
    # not clamp(max=1), whose gradient at z = 1 itself is 0 on some torch releases
    m = torch.expm1(z.masked_fill(z > 1, 1))
    near = torch.log1p(m * m / (2 * (1 + m)))
    far = z + torch.log1p(torch.exp(-2 * z)) - math.log(2)
    return torch.where(z <= 1, near, far).to(d.dtype)


def quantile_elementwise(input: Tensor, target: Tensor, q: float | Tensor) -> Tensor:
    """The pinball loss max((q - 1) e, q e) of e = target - input, in at least float32, as
    the kernels compute it; q a float or a tensor that broadcasts to the loss's shape (one
    quantile per element of the last dimension). Returned in the promoted dtype of the
    operands, broadcast first."""
    input, target = torch.broadcast_tensors(input, target)
    e = target - input
    x = e.to(torch.promote_types(e.dtype, torch.float32))
    q = (q.to(torch.promote_types(q.dtype, x.dtype)) if isinstance(q, Tensor)
         else torch.tensor(q, dtype=x.dtype, device=x.device))
    return torch.maximum((q - 1) * x, q * x).to(e.dtype)


def quantile_gradient(d: Tensor, q: float | Tensor) -> Tensor:
    """d loss / d input as autograd differentiates torch.maximum((q - 1) e, q e) of e = -d:
    1 - q where the first branch is larger, -q where the second is, the mean 1/2 - q at a
    tie, and both slopes, 1 - 2q, where they do not compare (NaN, 0 * inf)."""
    if isinstance(q, Tensor):
        q = q.to(d.dtype)
    above, below = (1 - q) * d, q * -d
    tie_or_nan = torch.where(above == below, 0.5 - q, torch.zeros_like(d) + (1 - 2 * q))
    return torch.where(above > below, 1 - q, torch.where(above < below, -q, tie_or_nan))


def reduced(per_element: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per_element
    if reduction == "sum":
        return per_element.sum()
    if reduction == "mean":
        return per_element.mean()
    raise ValueError(f"{reduction} is not a valid value for reduction")  # PyTorch's words
