"""Drop-in replacements for ``torch.nn.functional``'s regression losses.

On CUDA, float16, bfloat16, float32 and float64 operands (mixed pairs too)
run on fusedloss's kernels, in eager mode and under CUDA autocast (which these
losses follow: a float32 loss from 16-bit operands, read as they are) and CUDA
graphs. Everything else is handed to ``torch.nn.functional`` unchanged, so
results, warnings and errors there are PyTorch's own: CPU and other devices,
other dtypes, tensor subclasses, ``weight``, invalid beta or delta, operands on
different devices, torch.func transforms and forward-mode AD (which need
PyTorch's rules), ``torch.compile`` (whose inductor fuses PyTorch's formula
with the ops around the loss), and everything when the kernels cannot be built
(see ``build.use_kernels``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn import _reduction
from torch.overrides import has_torch_function_variadic

from . import build, gradient_placement, ops


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

_reduced_loss = torch.ops.fusedloss.reduced_loss.default
_pointwise_loss = torch.ops.fusedloss.pointwise_loss.default

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_16_BIT = (torch.float16, torch.bfloat16)
_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}
_MODES = ("mean", "sum", "none")
_NO_GRADIENTS = [False, False]
# From operands of this many bytes on (both together), a mean or sum may write
# its gradient in the forward pass (gradient_placement). Below, a step is bound
# by host time, not memory: backward computes the gradient from the operands,
# in as many launches and with no bookkeeping (docs/design.md, "Gradient placement").
FUSED_GRADIENT_FROM_BYTES = 1 << 27


def _kernels_apply(input: Tensor, target: Tensor) -> bool:
    return (
        # torch.compile traces torch.nn.functional instead, which inductor can fuse
        # with the ops around the loss (docs/design.md, "torch.compile").
        not torch.compiler.is_compiling()
        and isinstance(input, Tensor)
        and isinstance(target, Tensor)
        and not has_torch_function_variadic(input, target)
        and input.is_cuda
        and input.dtype in _KERNEL_DTYPES
        and target.dtype in _KERNEL_DTYPES
        and target.get_device() == input.get_device()
        and not _under_a_transform()
        and build.use_kernels()
    )


def _under_a_transform() -> bool:
    """torch.func transforms (grad, vmap, jvp, jacrev, ...) and forward-mode AD: the fused
    operators have no rules for them, so such calls run PyTorch's formula, which has."""
    return forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


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
    if target.shape != input.shape:
        warnings.warn(
            f"Using a target size ({target.size()}) that is different to the input size ({input.size()}). "
            "This will likely lead to incorrect results due to broadcasting. "
            "Please ensure they have the same size.",
            stacklevel=3,
        )
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    mode = reduction if reduction in _MODES else _REDUCTION_NAMES[_reduction.get_enum(reduction)]
    if loss == "smooth_l1" and param == 0.0:
        loss = "l1"  # as torch.nn.functional.smooth_l1_loss does
    # CUDA autocast runs these losses in float32 (they are on its float32 list).
    autocast = (input.dtype in _16_BIT or target.dtype in _16_BIT) and torch.is_autocast_enabled("cuda")
    if mode == "none":
        if autocast:
            input, target = ops.as_autocast_would(input), ops.as_autocast_would(target)
        return _pointwise_loss(input, target, loss, param)
    output_mask, slot = _NO_GRADIENTS, -1
    if (input.requires_grad or target.requires_grad) and torch.is_grad_enabled():
        numel = input.numel() if target.shape == input.shape else ops.broadcast_numel(input, target)
        if numel * (input.element_size() + target.element_size()) >= FUSED_GRADIENT_FROM_BYTES:
            if not gradient_placement.gradient_in_backward(loss, param, mode, input, target):
                output_mask = [input.requires_grad, target.requires_grad]
            slot = gradient_placement.history_slot(loss, param, mode, input, target)
    return _reduced_loss(input, target, loss, param, mode, output_mask, slot, autocast)[0]


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean squared error, as ``torch.nn.functional.mse_loss``."""
    if weight is not None or not _kernels_apply(input, target):
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
    if weight is not None or not _kernels_apply(input, target):
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
    if not (beta >= 0) or not _kernels_apply(input, target):
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
    if not (delta > 0) or weight is not None or not _kernels_apply(input, target):
        return F.huber_loss(input, target, reduction=reduction, delta=delta, **_weight_kwargs(weight))
    return _fused_loss("huber", float(delta), input, target, None, None, reduction)
