"""Drop-in replacements for ``torch.nn.functional``'s regression losses.

On CUDA, float16, bfloat16, float32 and float64 operands (mixed pairs too)
run on fusedloss's kernels. Everything else (CPU and other devices, other
dtypes, tensor subclasses, ``weight``, invalid beta or delta, operands on
different devices) is handed to ``torch.nn.functional`` unchanged, so results,
warnings and errors there are PyTorch's own. So is everything when the kernels
cannot be built (see ``build.use_kernels``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad
from torch.nn import _reduction
from torch.overrides import has_torch_function_variadic

from . import build, gradient_placement


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
# function below, and its module in nn.py.
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
}

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}


def _kernels_apply(input: Tensor, target: Tensor, weight: Tensor | None) -> bool:
    return (
        weight is None
        and isinstance(input, Tensor)
        and isinstance(target, Tensor)
        and not has_torch_function_variadic(input, target)
        and input.is_cuda
        and target.device == input.device
        and input.dtype in _KERNEL_DTYPES
        and target.dtype in _KERNEL_DTYPES
        and not _under_a_transform(input, target)
        and build.use_kernels()
    )


def _under_a_transform(input: Tensor, target: Tensor) -> bool:
    """torch.func transforms (grad, vmap, jvp, jacrev, ...) and forward-mode AD: the fused
    operators have no rules for them, so such calls run PyTorch's formula, which has."""
    if torch.compiler.is_compiling():
        return False
    return (
        forward_ad._current_level >= 0
        or _functorch.is_functorch_wrapped_tensor(input)
        or _functorch.is_functorch_wrapped_tensor(target)
    )


_AUTOCAST_TO_FLOAT32 = (torch.float16, torch.bfloat16)


def _as_autocast_would(operand: Tensor) -> Tensor:
    # CUDA autocast runs these losses in float32 (they are on its float32 list): it casts
    # 16-bit operands, differentiably, so the gradients come back in their dtypes.
    return operand.float() if operand.dtype in _AUTOCAST_TO_FLOAT32 else operand


def _weight_kwargs(weight: Tensor | None) -> dict:
    # torch < 2.6 has no `weight` argument; pass it on only when given.
    return {} if weight is None else {"weight": weight}


def _fused_loss(
    loss: str,
    param: float,
    input: Tensor,
    target: Tensor,
    size_average: bool | None,
    reduce: bool | None,
    reduction: str,
) -> Tensor:
    """The steps of torch.nn.functional's losses, in its order, then one fused op."""
    if torch.is_autocast_enabled("cuda"):
        input, target = _as_autocast_would(input), _as_autocast_would(target)
    if target.size() != input.size():
        warnings.warn(
            f"Using a target size ({target.size()}) that is different to the input size ({input.size()}). "
            "This will likely lead to incorrect results due to broadcasting. "
            "Please ensure they have the same size.",
            stacklevel=3,
        )
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    mode = _REDUCTION_NAMES[_reduction.get_enum(reduction)]
    if loss == "smooth_l1" and param == 0.0:
        loss = "l1"  # as torch.nn.functional.smooth_l1_loss does
    grad_enabled = torch.is_grad_enabled()
    output_mask = [grad_enabled and input.requires_grad, grad_enabled and target.requires_grad]
    if any(output_mask) or torch.compiler.is_compiling():
        if any(output_mask) and mode != "none" and gradient_placement.gradient_in_backward(
            loss, param, mode, input, target
        ):
            output_mask = [False, False]
        return _call_op(loss, param, input, target, mode, output_mask)
    # No gradient wanted: skip the Python autograd layer, whose overhead would
    # dominate small losses.
    with torch._C._AutoDispatchBelowAutograd():
        return _call_op(loss, param, input, target, mode, output_mask)


def _call_op(loss: str, param: float, input: Tensor, target: Tensor, mode: str, output_mask: list[bool]) -> Tensor:
    if mode == "none":
        return torch.ops.fusedloss.pointwise_loss.default(input, target, loss, param)
    return torch.ops.fusedloss.reduced_loss.default(input, target, loss, param, mode, output_mask)[0]


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean squared error, as ``torch.nn.functional.mse_loss``."""
    if not _kernels_apply(input, target, weight):
        return F.mse_loss(input, target, size_average, reduce, reduction, **_weight_kwargs(weight))
    return _fused_loss("mse", 0.0, input, target, size_average, reduce, reduction)


def l1_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean absolute error, as ``torch.nn.functional.l1_loss``."""
    if not _kernels_apply(input, target, weight):
        return F.l1_loss(input, target, size_average, reduce, reduction, **_weight_kwargs(weight))
    return _fused_loss("l1", 0.0, input, target, size_average, reduce, reduction)


def smooth_l1_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    beta: float = 1.0,
) -> Tensor:
    """Smooth L1 loss, as ``torch.nn.functional.smooth_l1_loss``; beta = 0 is L1."""
    if not (beta >= 0) or not _kernels_apply(input, target, None):
        return F.smooth_l1_loss(input, target, size_average, reduce, reduction, beta=beta)
    return _fused_loss("smooth_l1", float(beta), input, target, size_average, reduce, reduction)


def huber_loss(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Tensor | None = None,
) -> Tensor:
    """Huber loss, as ``torch.nn.functional.huber_loss``; returns the input's dtype."""
    if not (delta > 0) or not _kernels_apply(input, target, weight):
        return F.huber_loss(input, target, reduction=reduction, delta=delta, **_weight_kwargs(weight))
    return _fused_loss("huber", float(delta), input, target, None, None, reduction)
